"""Readers for data-loader scripts: CSV records into column arrays, malformed rows reported.

A malformed record (wrong number of fields, a value that does not parse, a non-finite
float, an id out of range) stops the reader with a :class:`BadRecordError` naming the
file and the row (the 1-based line number). With ``skip_bad_rows`` the reader skips such
rows instead, counts them, and reports the count and the first bad row when the file is
done (a warning in the log, and ``num_bad_rows`` on the reader).

    reader = CsvReader("train.csv", CsvReaderConfig(columns=(
        CsvColumn(name="label", kind="float"), CsvColumn(name="age", kind="float"),
        CsvColumn(name="tags", kind="ids")), header=True, skip_bad_rows=True))
    for batch in reader.batches(batch_size=1024):
        ...  # batch.values["age"]: float32 [n]; batch.id_lists["tags"]: (ids, lengths)
"""

from __future__ import annotations

import csv
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from persia_py.routing import RESERVED_ID

logger = logging.getLogger(__name__)


class BadRecordError(ValueError):
    """A malformed record; the message names the file and the row."""

    def __init__(self, path: str, row: int, reason: str) -> None:
        super().__init__(f"{path}: row {row}: {reason}")
        self.path, self.row, self.reason = path, row, reason


@dataclass(frozen=True, kw_only=True)
class CsvColumn:
    name: str
    """Key of the column in a batch's ``values`` or ``id_lists``."""
    kind: Literal["float", "int", "ids", "skip"]
    """``float``: one finite float32; ``int``: one int64; ``ids``: a (possibly empty) list
    of uint64 ids separated by ``id_separator``; ``skip``: read and ignored."""

    def __post_init__(self) -> None:
        if self.kind not in ("float", "int", "ids", "skip"):
            raise ValueError(f"column {self.name!r}: kind {self.kind!r} is not one of "
                             f"'float', 'int', 'ids', 'skip'")


@dataclass(frozen=True, kw_only=True)
class CsvReaderConfig:
    columns: tuple[CsvColumn, ...]
    """Every field of a record, in file order."""
    delimiter: str = ","
    """Field separator."""
    id_separator: str = " "
    """Separator of the ids inside an ``ids`` field."""
    header: bool = False
    """The first line names the columns and is skipped."""
    skip_bad_rows: bool = False
    """Skip and count malformed rows instead of stopping at the first one."""

    def __post_init__(self) -> None:
        if not self.columns:
            raise ValueError("columns: at least one column is required")
        names = [c.name for c in self.columns if c.kind != "skip"]
        if len(set(names)) != len(names):
            raise ValueError(f"columns: names must be unique, got {names}")
        if len(self.delimiter) != 1 or not self.id_separator or self.id_separator == self.delimiter:
            raise ValueError(f"delimiter must be one character and id_separator a different, "
                             f"non-empty string; got {self.delimiter!r}, {self.id_separator!r}")


@dataclass
class CsvBatch:
    """Up to ``batch_size`` good records, as columns."""

    values: dict[str, np.ndarray]
    """``float`` columns as float32 ``[n]``, ``int`` columns as int64 ``[n]``."""
    id_lists: dict[str, tuple[np.ndarray, np.ndarray]]
    """``ids`` columns as (uint64 ids of all records, int32 per-record lengths ``[n]``)."""
    rows: np.ndarray = field(repr=False)
    """Row (line number) of each record, int64 ``[n]``."""

    @property
    def num_records(self) -> int:
        return int(self.rows.size)


class CsvReader:
    """Reads one CSV file in batches; ``num_rows``/``num_bad_rows`` count what was read."""

    def __init__(self, path: str | os.PathLike, config: CsvReaderConfig) -> None:
        self.path = os.fspath(path)
        self.config = config
        self.num_rows = 0
        self.num_bad_rows = 0
        self.first_bad: BadRecordError | None = None

    def batches(self, batch_size: int) -> Iterator[CsvBatch]:
        """Yield batches of ``batch_size`` good records (the last may be shorter)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        pending: list[tuple[int, list]] = []
        for row, record in self._records():
            pending.append((row, record))
            if len(pending) == batch_size:
                yield self._batch(pending)
                pending = []
        if pending:
            yield self._batch(pending)
        if self.num_bad_rows:
            logger.warning("%s: skipped %d malformed rows of %d (first: %s)", self.path,
                           self.num_bad_rows, self.num_rows, self.first_bad)

    def read_all(self) -> CsvBatch:
        """Every good record of the file as one batch."""
        batches = list(self.batches(1 << 62))
        return batches[0] if batches else self._batch([])

    def _records(self) -> Iterator[tuple[int, list]]:
        cfg = self.config
        with open(self.path, newline="", encoding="utf-8", errors="replace") as f:
            reader = csv.reader(f, delimiter=cfg.delimiter, strict=True)
            first = True
            while True:
                try:
                    fields = next(reader)
                except StopIteration:
                    return
                except csv.Error as exc:
                    self._bad(reader.line_num, f"not valid CSV: {exc}")
                    continue
                if first and cfg.header:
                    first = False
                    continue
                first = False
                if not fields:
                    continue  # blank line
                self.num_rows += 1
                try:
                    record = self._parse(fields)
                except ValueError as exc:
                    self._bad(reader.line_num, str(exc))
                    continue
                yield reader.line_num, record

    def _bad(self, row: int, reason: str) -> None:
        error = BadRecordError(self.path, row, reason)
        if not self.config.skip_bad_rows:
            raise error
        self.num_bad_rows += 1
        if self.first_bad is None:
            self.first_bad = error

    def _parse(self, fields: list[str]) -> list:
        columns = self.config.columns
        if len(fields) != len(columns):
            raise ValueError(f"{len(fields)} fields, expected {len(columns)}")
        parsed = []
        for column, text in zip(columns, fields):
            if column.kind == "skip":
                continue
            text = text.strip()
            try:
                if column.kind == "float":
                    value = float(text)
                    if not math.isfinite(value):
                        raise ValueError("not finite")
                elif column.kind == "int":
                    value = int(text)
                    if not -(2**63) <= value < 2**63:
                        raise ValueError("out of the int64 range")
                else:
                    value = [int(t) for t in text.split(self.config.id_separator) if t]
                    if any(not 0 <= v < int(RESERVED_ID) for v in value):
                        raise ValueError(f"ids must be in [0, {int(RESERVED_ID)})")
            except ValueError as exc:
                raise ValueError(f"column {column.name!r}: {text[:40]!r} is not a valid "
                                 f"{column.kind} ({exc})") from None
            parsed.append(value)
        return parsed

    def _batch(self, records: list[tuple[int, list]]) -> CsvBatch:
        columns = [c for c in self.config.columns if c.kind != "skip"]
        values, id_lists = {}, {}
        for i, column in enumerate(columns):
            cells = [record[i] for _, record in records]
            if column.kind == "ids":
                lengths = np.array([len(c) for c in cells], dtype=np.int32)
                ids = np.fromiter((v for c in cells for v in c), dtype=np.uint64,
                                  count=int(lengths.sum()))
                id_lists[column.name] = (ids, lengths)
            else:
                values[column.name] = np.array(
                    cells, dtype=np.float32 if column.kind == "float" else np.int64)
        rows = np.array([row for row, _ in records], dtype=np.int64)
        return CsvBatch(values=values, id_lists=id_lists, rows=rows)

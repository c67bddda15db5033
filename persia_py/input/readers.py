"""Readers for data-loader scripts: CSV records into column arrays, malformed rows reported.

A malformed record (wrong number of fields, a value that does not parse, a non-finite
float, an id out of range) stops the reader with a :class:`BadRecordError` naming the
file and the row (the 1-based line number). With ``skip_bad_rows`` the reader skips such
rows instead, counts them, and reports the count and the first bad row when the file is
done (a warning in the log, and ``num_bad_rows`` on the reader). A line longer than
``max_record_bytes`` is such a malformed row too, found before it is held in memory.

    reader = CsvReader("train.csv", CsvReaderConfig(columns=(
        CsvColumn(name="label", kind="float"), CsvColumn(name="age", kind="float"),
        CsvColumn(name="tags", kind="ids")), header=True, skip_bad_rows=True))
    for batch in reader.batches(batch_size=1024):
        ...  # batch.values["age"]: float32 [n]; batch.id_lists["tags"]: (ids, lengths)

In a data-loader process the reader reads only that loader's share of the file (see
:mod:`persia_py.input.reader_share`): with ``n`` loaders every line is read by exactly one of
them, with no code of the user's. Pass ``share=ReaderShare.whole()`` to read all of it.
"""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from persia_py.ids import hash_values
from persia_py.ids.routing import RESERVED_ID
from persia_py.input.reader_share import ReaderShare
from persia_py.ops.final_errors import DataError

logger = logging.getLogger(__name__)
_FLOAT32_OVERFLOW = 2.0**128 * (1 - 2.0**-25)
"""The smallest magnitude a float64 rounds to infinity at in float32."""


class BadRecordError(DataError):
    """A malformed record; the message names the file and the row (and the column, where
    one field is wrong). A :class:`~persia_py.ops.final_errors.DataError`: final in a data
    loader."""

    def __init__(self, path: str, row: int, reason: str) -> None:
        super().__init__(f"{path}: row {row}: {reason}")
        self.path, self.row, self.reason = path, row, reason


def record_too_long(limit: int, num_bytes: int | None = None) -> str:
    """The reason of a :class:`BadRecordError` for a line over ``max_record_bytes``."""
    size = f"more than {limit}" if num_bytes is None else str(num_bytes)
    return (f"a line of {size} bytes, over max_record_bytes ({limit}); raise "
            "CsvReaderConfig(max_record_bytes=...) if such records are meant")


def field_count_error(found: int, config: CsvReaderConfig) -> str:
    """The reason of a :class:`BadRecordError` for a record of ``found`` fields: which
    column is missing, or that fields past the last column are extra."""
    names = [c.name for c in config.columns]
    if found < len(names):
        where = f"no field for column {names[found]!r} or after it"
    else:
        where = f"{found - len(names)} field(s) after the last column {names[-1]!r}"
    return f"{found} fields, expected {len(names)} ({', '.join(names)}): {where}"


def check_header(config: CsvReaderConfig, fields: list[str], path: str) -> None:
    """BadRecordError (row 1) unless ``fields``, a file's first line split, are a header
    naming ``config``'s columns: as many fields, each column's name where the column is
    (any name for a ``skip`` column). A first line skipped unchecked would drop a record
    of a file without a header, or read a file whose columns are not the configured ones."""
    expected = [c.name for c in config.columns]
    if len(fields) == len(expected) and all(
            c.kind == "skip" or f.strip() == c.name for c, f in zip(config.columns, fields)):
        return
    shown = repr(fields) if len(repr(fields)) <= 200 else repr(fields)[:200] + "..."
    names = [f.strip() for f in fields]
    missing = [c.name for c in config.columns if c.kind != "skip" and c.name not in names]
    if missing:
        where = f"column {missing[0]!r} is missing"
    elif len(fields) < len(expected):
        where = f"no field for column {expected[len(fields)]!r}"
    elif len(fields) > len(expected):
        where = f"{len(fields) - len(expected)} field(s) after the last column {expected[-1]!r}"
    else:
        where = next(f"column {i + 1} is named {f!r}, not {c.name!r}"
                     for i, (c, f) in enumerate(zip(config.columns, names))
                     if c.kind != "skip" and f != c.name)
    raise BadRecordError(path, 1, f"{where}: CsvReaderConfig(header=True), but the first "
                                  f"line's fields {shown} are not the header naming the "
                                  f"columns {expected} (a 'skip' column's field may have any "
                                  "name); name the columns as the file's header does, or set "
                                  "header=False if the files have none")


@dataclass(frozen=True, kw_only=True)
class CsvColumn:
    name: str
    """Key of the column in a batch's ``values`` or ``id_lists``."""
    kind: Literal["float", "int", "ids", "category", "skip"]
    """``float``: one finite float32; ``int``: one int64; ``ids``: a (possibly empty) list
    of uint64 ids separated by ``id_separator``; ``category``: one string (e.g. Criteo's
    hex values; empty is a value too) made an id by :func:`persia_py.ids.hash_values`;
    ``skip``: read and ignored."""
    default: float | None = None
    """``float`` and ``int`` columns: the value of an empty field (or one of spaces only:
    Criteo's missing counts); None: an empty field is a malformed record. An ``int``
    column's default is a whole number in the int64 range."""
    salt: str | None = None
    """``category`` columns: the hash's salt (None: the column's name). Give columns that
    share a table (``feature_groups``) the same salt."""

    def __post_init__(self) -> None:
        if self.kind not in ("float", "int", "ids", "category", "skip"):
            raise ValueError(f"column {self.name!r}: kind {self.kind!r} is not one of "
                             f"'float', 'int', 'ids', 'category', 'skip'")
        if self.default is not None and self.kind not in ("float", "int"):
            raise ValueError(f"column {self.name!r}: default is for 'float' and 'int' "
                             f"columns, not {self.kind!r}")
        if self.kind == "int" and self.default is not None and not (
                float(self.default).is_integer() and -(2**63) <= self.default < 2**63):
            raise ValueError(f"column {self.name!r}: an 'int' column's default must be a "
                             f"whole number in the int64 range, got {self.default!r}")
        if self.salt is not None and self.kind != "category":
            raise ValueError(f"column {self.name!r}: salt is for 'category' columns, not "
                             f"{self.kind!r}")


@dataclass(frozen=True, kw_only=True)
class CsvReaderConfig:
    columns: tuple[CsvColumn, ...]
    """Every field of a record, in file order."""
    delimiter: str = ","
    """Field separator."""
    id_separator: str = " "
    """Separator of the ids inside an ``ids`` field."""
    header: bool = False
    """The first line of every file names the columns and is skipped, once checked: it
    must have a field per column, each the column's name (any for a ``skip`` column)."""
    skip_bad_rows: bool = False
    """Skip and count malformed rows instead of stopping at the first one."""
    max_record_bytes: int = 1 << 20
    """The longest line a record may have, in bytes (its newline not counted; 1 MiB by
    default). A longer line is a malformed record, found before it is held in memory:
    this bounds a batch's memory at about ``batch_size`` times it."""

    def __post_init__(self) -> None:
        if not self.columns:
            raise ValueError("columns: at least one column is required")
        names = [c.name for c in self.columns if c.kind != "skip"]
        if len(set(names)) != len(names):
            raise ValueError(f"columns: names must be unique, got {names}")
        if len(self.delimiter) != 1 or not self.id_separator or self.id_separator == self.delimiter:
            raise ValueError(f"delimiter must be one character and id_separator a different, "
                             f"non-empty string; got {self.delimiter!r}, {self.id_separator!r}")
        if (not isinstance(self.max_record_bytes, int) or isinstance(self.max_record_bytes, bool)
                or self.max_record_bytes < 1):
            raise ValueError(f"max_record_bytes must be an int >= 1 (bytes in a line), got "
                             f"{self.max_record_bytes!r}")


@dataclass
class CsvBatch:
    """Up to ``batch_size`` good records, as columns."""

    values: dict[str, np.ndarray]
    """``float`` columns as float32 ``[n]``, ``int`` columns as int64 ``[n]``."""
    id_lists: dict[str, tuple[np.ndarray, np.ndarray]]
    """``ids`` and ``category`` columns as (uint64 ids of all records, int32 per-record
    lengths ``[n]``; a ``category`` record has one id)."""
    rows: np.ndarray = field(repr=False)
    """Row (line number) of each record, int64 ``[n]``."""

    @property
    def num_records(self) -> int:
        return int(self.rows.size)


class CsvReader:
    """Reads one CSV file in batches; ``num_rows``/``num_bad_rows`` count what was read.

    ``share``: the part of the file to read (None: :meth:`ReaderShare.of_this_process`,
    this data loader's share, or the whole file outside a data-loader process). Rows
    keep the file's line numbers whatever the share."""

    def __init__(self, path: str | os.PathLike, config: CsvReaderConfig, *,
                 share: ReaderShare | None = None) -> None:
        self.path = os.fspath(path)
        self.config = config
        self.share = ReaderShare.of_this_process() if share is None else share
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
        start, end = self.share.byte_range(self.path)
        with open(self.path, "rb") as f:
            lines_before = _count_newlines(f, start)
            f.seek(start)
            reader = csv.reader(self._lines(f, end - start, lines_before + 1),
                                delimiter=cfg.delimiter, strict=True)
            first = start == 0
            while True:
                line_before = reader.line_num
                try:
                    fields = next(reader)
                except StopIteration:
                    return
                except csv.Error as exc:
                    self._bad(lines_before + reader.line_num, f"not valid CSV: {exc}"
                              + ("" if self.share.is_whole else f"; {self._unshareable()}"))
                    continue
                row = lines_before + reader.line_num
                if first and cfg.header:
                    first = False
                    check_header(cfg, fields, self.path)
                    continue
                first = False
                if not fields:
                    continue  # blank line
                self.num_rows += 1
                if reader.line_num - line_before > 1 and not self.share.is_whole:
                    # Shares are cut between lines: the next loader began inside this record.
                    raise BadRecordError(self.path, row, f"a record of "
                                         f"{reader.line_num - line_before} lines; "
                                         + self._unshareable())
                try:
                    record = self._parse(fields)
                except ValueError as exc:
                    # A share that starts inside a multi-line record sees its tail first.
                    cut = start > 0 and line_before == 0
                    self._bad(row, str(exc) + (f"; or {self._unshareable()}" if cut else ""))
                    continue
                yield row, record

    def _lines(self, f, num_bytes: int, first_line: int) -> Iterator[str]:
        """The lines in the next ``num_bytes`` of binary ``f`` (they end on a line end), as
        text; bytes that are not UTF-8 are replaced (the field then fails to parse). A
        line over ``max_record_bytes`` is a bad row, never held whole: it is read past in
        pieces and an empty line takes its place, so later rows keep their numbers."""
        limit = self.config.max_record_bytes
        left, line_number = num_bytes, first_line
        while left > 0:
            line = f.readline(min(left, limit + 1))
            if not line:
                return
            left -= len(line)
            if len(line) > limit and not line.endswith(b"\n"):
                self.num_rows += 1
                self._bad(line_number, record_too_long(limit))
                while left > 0 and line and not line.endswith(b"\n"):
                    line = f.readline(min(left, 1 << 16))
                    left -= len(line)
                line = b"\n"
            line_number += 1
            yield line.decode("utf-8", errors="replace")

    def _unshareable(self) -> str:
        return (f"a record spanning lines cannot be shared between data loaders (share "
                f"{self.share.index} of {self.share.count}): read the file whole with "
                f"share=ReaderShare.whole(), or write one record per line")

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
            raise ValueError(field_count_error(len(fields), self.config))
        parsed: list = []
        value: float | list[int]
        for column, text in zip(columns, fields):
            if column.kind == "skip":
                continue
            text = text.strip()
            if column.kind == "category":
                parsed.append(text)
                continue
            if not text and column.default is not None:
                parsed.append(column.default)
                continue
            try:
                if column.kind == "float":
                    value = float(text)
                    if not abs(value) < _FLOAT32_OVERFLOW:  # NaN too
                        raise ValueError("not a finite float32")
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
            if column.kind == "category":
                id_lists[column.name] = (
                    hash_values(np.array(cells, dtype=np.str_).reshape(-1),
                                salt=column.name if column.salt is None else column.salt),
                    np.ones(len(cells), dtype=np.int32))
            elif column.kind == "ids":
                lengths = np.array([len(c) for c in cells], dtype=np.int32)
                ids = np.fromiter((v for c in cells for v in c), dtype=np.uint64,
                                  count=int(lengths.sum()))
                id_lists[column.name] = (ids, lengths)
            else:
                values[column.name] = np.array(
                    cells, dtype=np.float32 if column.kind == "float" else np.int64)
        rows = np.array([row for row, _ in records], dtype=np.int64)
        return CsvBatch(values=values, id_lists=id_lists, rows=rows)


def _count_newlines(f, num_bytes: int) -> int:
    """Newlines in the first ``num_bytes`` of ``f``: the lines before a share, so that its
    rows keep the file's line numbers (a scan at memory speed, nothing parsed)."""
    f.seek(0)
    count, left = 0, num_bytes
    while left > 0:
        chunk = f.read(min(left, 1 << 22))
        if not chunk:
            break
        count += chunk.count(b"\n")
        left -= len(chunk)
    return count



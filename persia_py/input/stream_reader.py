"""Readers of a growing, time-ordered input: a stream of record batches that never ends.

A :class:`StreamReader` follows either

* a **folder**: files matching ``pattern`` are read one after the other in name order
  (name them by time, e.g. ``2026-12-03T10-00.csv``). The newest file may still grow
  (CSV): its complete lines are read as they are appended, and it counts as finished
  once a later file exists. Files starting with ``.`` are ignored, so a writer can write
  ``.part`` and rename it into place (Parquet files must appear whole that way). A file
  that appears with a name before one already read is an error, never skipped. Links
  are not followed: a symbolic link among the files (to a file or a folder) is an error,
  and every file is opened with ``O_NOFOLLOW``; or
* one **file** (CSV) that lines are appended to; it never finishes. Given as a link, it is
  resolved once, when the reader is made.

Only complete lines are read: a partial last line waits for its newline (in a finished
file the last line needs none). A line longer than ``max_record_bytes`` (of the
:class:`~persia_py.input.readers.CsvReaderConfig`) is an error naming the file and line,
found while scanning, before the line is held in memory. A batch never spans two files;
it is shorter than ``batch_size`` at the end of a file, or when no more data came within
``max_wait_sec``.

Every batch carries its exact :class:`StreamPosition` range (file name, byte offset and
line for CSV, row for Parquet), and :meth:`StreamReader.read` reads a range again, byte
for byte: that is what makes a restarted loader exact (:mod:`persia_py.stream_source`).
CSV is parsed with array operations (:func:`persia_py.input.csv_parse.parse_csv_lines`),
Parquet through ``pyarrow`` (``pip install persia_py[parquet]``).
"""

from __future__ import annotations

import csv
import errno
import fnmatch
import os
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from persia_py.ids.routing import RESERVED_ID
from persia_py.input.csv_parse import check_line_lengths, parse_csv_lines
from persia_py.input.readers import (
    BadRecordError,
    CsvBatch,
    CsvColumn,
    CsvReaderConfig,
    check_header,
    record_too_long,
)

_FIRST_CHUNK, _READ_CHUNK = 1 << 16, 1 << 20  # a scan reads 64 KiB, then doubles to 1 MiB
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
               | getattr(os, "O_NONBLOCK", 0))  # a FIFO put in the folder must not block


@dataclass(frozen=True)
class StreamPosition:
    """A point in the stream: before the record at ``offset`` of ``file``."""

    file: str
    """The file's name (in the followed folder, or the followed file's own name)."""
    offset: int = 0
    """CSV: byte offset in the file. Parquet: 0."""
    row: int = 0
    """CSV: lines before ``offset`` (a header and blank lines included). Parquet: rows
    before this point."""

    def to_json(self) -> list:
        return [self.file, self.offset, self.row]

    @classmethod
    def from_json(cls, data: object, where: str) -> StreamPosition:
        if (not isinstance(data, list) or len(data) != 3 or not isinstance(data[0], str)
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                           for v in data[1:])):
            raise ValueError(f"{where}: expected [file name, offset >= 0, row >= 0], got "
                             f"{data!r}")
        return cls(*data)


@dataclass
class StreamBatch:
    """Records read from ``start`` up to ``end`` (one file)."""

    records: CsvBatch
    """The records as columns (see :class:`persia_py.input.readers.CsvBatch`); ``rows``
    holds each record's line (CSV) or 1-based row (Parquet) in its file."""
    start: StreamPosition
    end: StreamPosition

    @property
    def num_records(self) -> int:
        return self.records.num_records


class CsvFormat:
    """CSV records, fields as ``config`` says (no quoting; a one-character id separator)."""

    final_when_written = False  # a CSV file may grow until a later file exists

    def __init__(self, config: CsvReaderConfig) -> None:
        if len(config.id_separator) != 1:
            raise ValueError(f"id_separator: the streaming reader needs one character, got "
                             f"{config.id_separator!r}")
        if config.skip_bad_rows:
            raise ValueError("skip_bad_rows: a stream stops at a malformed row (it cannot "
                             "skip one and still replay exactly); set it to False")
        self.config = config


class ParquetFormat:
    """Parquet records: ``columns`` name the file's columns (``float``, ``int``, ``ids``:
    a list of integers or one integer per row; ``skip`` columns are not read; no
    ``category`` and no ``default``)."""

    final_when_written = True  # a Parquet file appears whole (written, then renamed)

    def __init__(self, columns: tuple[CsvColumn, ...]) -> None:
        if not columns:
            raise ValueError("columns: at least one column is required")
        for column in columns:
            if column.kind == "category" or column.default is not None:
                raise ValueError(f"column {column.name!r}: Parquet columns take no "
                                 f"{'default' if column.default is not None else 'category'}"
                                 " (nulls are errors; hash strings with persia_py.ids."
                                 "hash_values before writing, into an 'ids' column)")
        self.columns = tuple(columns)
        self.pa = _pyarrow()


def _pyarrow() -> Any:
    try:
        import pyarrow  # noqa: F401 - checked here, used through pyarrow.parquet
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("reading Parquet needs pyarrow: pip install 'persia_py[parquet]' "
                          "(or pip install pyarrow)") from None
    return pq


class StreamReader:
    """Batches of a growing input (see the module docstring).

    Args:
        path: a folder to follow new files in, or one CSV file to follow appends to.
        fmt: :class:`CsvFormat` or :class:`ParquetFormat`.
        pattern: which files of the folder are read (``fnmatch``, e.g. ``"*.csv"``).
        poll_interval_sec: how often to look for new data when there is none.
        max_wait_sec: a batch shorter than ``batch_size`` goes out once no more data
            came for this long after its first record.
        idle_timeout_sec: end the stream after this long without new data (None: never;
            an online job runs until it is stopped).
        stop: ends the stream when set (checked while waiting for data).
    """

    def __init__(self, path: str | os.PathLike, fmt: CsvFormat | ParquetFormat, *,
                 pattern: str = "*", poll_interval_sec: float = 0.2, max_wait_sec: float = 1.0,
                 idle_timeout_sec: float | None = None,
                 stop: threading.Event | None = None) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.folder_mode = os.path.isdir(self.path)
        if not self.folder_mode:
            self.path = os.path.realpath(self.path)  # the file named, not what a link says later
        if not self.folder_mode and not os.path.isfile(self.path):
            raise FileNotFoundError(f"stream path {self.path}: neither a folder nor a file")
        if not self.folder_mode and not isinstance(fmt, CsvFormat):
            raise ValueError(f"{self.path}: following one file needs CSV (a Parquet file "
                             "cannot be appended to); follow a folder of Parquet files")
        for name, value in (("poll_interval_sec", poll_interval_sec),
                            ("max_wait_sec", max_wait_sec)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if idle_timeout_sec is not None and not idle_timeout_sec > 0:
            raise ValueError(f"idle_timeout_sec must be > 0 or None, got {idle_timeout_sec}")
        self.stop = stop or threading.Event()
        self.fmt = fmt
        self.pattern = pattern
        self.poll_interval_sec = poll_interval_sec
        self.max_wait_sec = max_wait_sec
        self.idle_timeout_sec = idle_timeout_sec
        self._seen: set[str] = set()
        self._table: tuple[str, Any] | None = None  # the Parquet file being read

    # -- files ---------------------------------------------------------------------------

    def files(self) -> list[str]:
        """The names of the stream's files now, in reading order."""
        if not self.folder_mode:
            return [os.path.basename(self.path)]
        names = []
        with os.scandir(self.path) as entries:
            for entry in entries:
                if not self._is_stream_name(entry.name):
                    continue
                if entry.is_symlink():
                    raise ValueError(self._link_refused(entry.name))
                if entry.is_file(follow_symlinks=False):  # folders (and FIFOs) are not read
                    names.append(entry.name)
        return sorted(names)

    def _is_stream_name(self, name: str) -> bool:
        return not name.startswith(".") and fnmatch.fnmatchcase(name, self.pattern)

    def _link_refused(self, name: str) -> str:
        return (f"{self.path}: {name!r} is a symbolic link; a stream's links are not followed "
                "(one could point at any file this loader can read): put the file itself in "
                "the folder (move or copy it)")

    def _file(self, name: str) -> str:
        """The path of the stream's file ``name`` (from a listing or a position log)."""
        if not self.folder_mode:
            if name != os.path.basename(self.path):
                raise ValueError(f"{self.path}: a stream position names {name!r}, another file")
            return self.path
        if os.sep in name or (os.altsep and os.altsep in name) or not self._is_stream_name(name):
            raise ValueError(f"{self.path}: a stream position names {name!r}, not a file of "
                             f"this stream (a name in the folder matching {self.pattern!r})")
        return os.path.join(self.path, name)

    def _open(self, name: str):
        """The stream's file ``name`` opened for reading, never through a link."""
        path = self._file(name)
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):
                raise ValueError(self._link_refused(name)) from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ValueError(f"{path}: not a regular file")
        return os.fdopen(fd, "rb")

    def _check_order(self, files: list[str], current: str) -> None:
        """A file named before the one being read that was not there before is an error:
        skipping it would drop its records silently."""
        late = [n for n in files if n < current and n not in self._seen]
        if late and self._seen:
            raise RuntimeError(f"{self.path}: file {late[0]!r} appeared after {current!r} was "
                               "being read; files must arrive in name order")
        self._seen.update(files)

    # -- reading -------------------------------------------------------------------------

    def batches(self, batch_size: int, start: StreamPosition | None = None
                ) -> Iterator[StreamBatch]:
        """Batches of up to ``batch_size`` records from ``start`` (default: the first
        file's beginning) on, without end unless ``idle_timeout_sec`` or ``stop``."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        pos = start if start is not None else self._first_position()
        if pos is None:
            return
        self._seen = {n for n in self.files() if n <= pos.file}
        if pos.file not in self._seen:
            raise FileNotFoundError(f"{self.path}: the stream position names {pos.file!r}, "
                                    "which is not there")
        last_data = pending_since = time.monotonic()
        pending = False
        while not self.stop.is_set():
            files = self.files()
            self._check_order(files, pos.file)
            later = any(n > pos.file for n in files)
            final = later or self.fmt.final_when_written
            end, num_lines = self._scan(pos, batch_size, final)
            now = time.monotonic()
            if num_lines and (num_lines >= batch_size or final or
                              (pending and now - pending_since >= self.max_wait_sec)):
                batch = self.read(pos, end)
                pos, pending, last_data = end, False, now
                if batch.num_records:  # lines that were all blank (or a header) make none
                    yield batch
                continue
            if not num_lines and later:
                pos = StreamPosition(min(n for n in files if n > pos.file))
                continue
            if num_lines and not pending:
                pending, pending_since = True, now
            if self.idle_timeout_sec is not None and now - last_data >= self.idle_timeout_sec:
                if num_lines:  # complete lines still waiting for max_wait_sec: the end sends them
                    batch = self.read(pos, end)
                    if batch.num_records:
                        yield batch
                return
            self.stop.wait(self.poll_interval_sec)

    def _first_position(self) -> StreamPosition | None:
        started = time.monotonic()
        while not self.stop.is_set():
            files = self.files()
            if files:
                return StreamPosition(files[0])
            if (self.idle_timeout_sec is not None
                    and time.monotonic() - started >= self.idle_timeout_sec):
                return None
            self.stop.wait(self.poll_interval_sec)
        return None

    def _scan(self, pos: StreamPosition, max_rows: int, final: bool
              ) -> tuple[StreamPosition, int]:
        """Where up to ``max_rows`` complete records from ``pos`` end, and how many."""
        if isinstance(self.fmt, ParquetFormat):
            total = self._parquet(pos.file).num_rows
            if pos.row > total:
                raise ValueError(f"{self._file(pos.file)}: the stream position is at row "
                                 f"{pos.row}, the file has {total}")
            num = min(max_rows, total - pos.row)
            return StreamPosition(pos.file, 0, pos.row + num), num
        header = int(self.fmt.config.header and pos.row == 0)  # a line, not a record
        end, num = self._scan_lines(pos, max_rows + header, final)
        return end, max(num - header, 0)

    def _scan_lines(self, pos: StreamPosition, max_rows: int, final: bool
                    ) -> tuple[StreamPosition, int]:
        path = self._file(pos.file)
        with self._open(pos.file) as f:
            size = os.fstat(f.fileno()).st_size
            if pos.offset > size:
                raise ValueError(f"{path}: the stream position is at byte {pos.offset}, the "
                                 f"file has {size} (was it truncated or replaced?)")
            f.seek(pos.offset)
            newlines = np.zeros(0, np.int64)
            read, chunk_size = 0, _FIRST_CHUNK
            while newlines.size < max_rows:
                chunk = f.read(chunk_size)
                chunk_size = min(2 * chunk_size, _READ_CHUNK)
                if not chunk:
                    break
                found = np.flatnonzero(np.frombuffer(chunk, np.uint8) == ord("\n")) + read
                newlines = np.concatenate([newlines, found])
                read += len(chunk)
                self._check_line_lengths(path, pos, newlines[:max_rows], read, max_rows)
        if newlines.size >= max_rows:
            return StreamPosition(pos.file, pos.offset + int(newlines[max_rows - 1]) + 1,
                                  pos.row + max_rows), max_rows
        num, end = int(newlines.size), pos.offset + (int(newlines[-1]) + 1 if newlines.size else 0)
        if final and pos.offset + read > end:  # a finished file's last line needs no newline
            return StreamPosition(pos.file, pos.offset + read, pos.row + num + 1), num + 1
        return StreamPosition(pos.file, end, pos.row + num), num

    @property
    def _csv_config(self) -> CsvReaderConfig:
        assert isinstance(self.fmt, CsvFormat), "a CSV step on a Parquet stream"
        return self.fmt.config

    def _check_line_lengths(self, path: str, pos: StreamPosition, newlines: np.ndarray,
                            read: int, max_rows: int) -> None:
        """A line over ``max_record_bytes`` among those scanned is an error, a partial one
        as soon as it is over (its bytes are never held)."""
        limit = self._csv_config.max_record_bytes
        check_line_lengths(np.diff(newlines, prepend=-1) - 1, limit, path, pos.row + 1)
        tail = read - (int(newlines[-1]) + 1 if newlines.size else 0)
        if newlines.size < max_rows and tail > limit:
            raise BadRecordError(path, pos.row + newlines.size + 1, record_too_long(limit))

    def read(self, start: StreamPosition, end: StreamPosition) -> StreamBatch:
        """The records from ``start`` to ``end`` again (both in one file), exactly as
        :meth:`batches` gave them."""
        if start.file != end.file or (start.offset, start.row) > (end.offset, end.row):
            raise ValueError(f"read({start}, {end}): not a range within one file")
        if isinstance(self.fmt, ParquetFormat):
            records = self._parquet_records(start, end)
        else:
            records = self._csv_records(start, end)
        return StreamBatch(records=records, start=start, end=end)

    def _csv_records(self, start: StreamPosition, end: StreamPosition) -> CsvBatch:
        path = self._file(start.file)
        with self._open(start.file) as f:
            f.seek(start.offset)
            data = f.read(end.offset - start.offset)
        if len(data) != end.offset - start.offset:
            raise ValueError(f"{path}: bytes {start.offset}..{end.offset} are not all there "
                             "(was the file truncated or replaced?)")
        if data and not data.endswith(b"\n"):
            data += b"\n"  # the last line of a finished file
        first_line = start.row + 1
        if self._csv_config.header and start.row == 0:
            cut = data.find(b"\n") + 1
            line = data[:cut].decode("utf-8", errors="replace").rstrip("\r\n")
            check_header(self._csv_config, next(csv.reader(
                [line], delimiter=self._csv_config.delimiter), []), path)
            data, first_line = data[cut:], 2
        return parse_csv_lines(data, self._csv_config, path, first_line)

    # -- Parquet -------------------------------------------------------------------------

    @property
    def _parquet_format(self) -> ParquetFormat:
        assert isinstance(self.fmt, ParquetFormat), "a Parquet step on a CSV stream"
        return self.fmt

    def _parquet(self, name: str):
        """The Parquet file ``name``'s needed columns, read once while it is current."""
        if self._table is None or self._table[0] != name:
            path = self._file(name)
            wanted = [c.name for c in self._parquet_format.columns if c.kind != "skip"]
            with self._open(name) as f:
                try:
                    table = self._parquet_format.pa.read_table(f, columns=wanted)
                except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds
                    raise ValueError(f"{path}: cannot read the Parquet columns {wanted}: "
                                     f"{exc}") from exc
            self._table = (name, table)
        return self._table[1]

    def _parquet_records(self, start: StreamPosition, end: StreamPosition) -> CsvBatch:
        path = self._file(start.file)
        table = self._parquet(start.file).slice(start.row, end.row - start.row)
        values, id_lists = {}, {}
        for column in self._parquet_format.columns:
            if column.kind == "skip":
                continue
            data = table.column(column.name).combine_chunks()
            if data.null_count:
                row = start.row + 1 + int(np.flatnonzero(data.is_null().to_numpy(
                    zero_copy_only=False))[0])
                raise BadRecordError(path, row, f"column {column.name!r} is null")
            if column.kind == "ids":
                id_lists[column.name] = _parquet_ids(data, column, path, start.row)
            else:
                dtype = np.float32 if column.kind == "float" else np.int64
                array = np.asarray(data.to_numpy(zero_copy_only=False))
                if column.kind == "float":
                    if array.dtype.kind not in "fiu":
                        raise ValueError(f"{path}: column {column.name!r} is {data.type}, "
                                         "not a number")
                    finite = np.isfinite(array)
                    if not finite.all():
                        raise BadRecordError(path, start.row + 1 + int(np.argmin(finite)),
                                             f"column {column.name!r} is not finite")
                elif array.dtype.kind not in "iu":
                    raise ValueError(f"{path}: column {column.name!r} is {data.type}, not an "
                                     "integer")
                values[column.name] = array.astype(dtype)
        rows = np.arange(start.row + 1, end.row + 1, dtype=np.int64)
        return CsvBatch(values=values, id_lists=id_lists, rows=rows)


def _parquet_ids(data, column: CsvColumn, path: str, first_row: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """An ``ids`` column (a list of integers, or one integer, per row) as (ids, lengths)."""
    import pyarrow as pa

    if pa.types.is_list(data.type) or pa.types.is_large_list(data.type):
        lengths = np.asarray(data.value_lengths().to_numpy(zero_copy_only=False), np.int32)
        flat = data.flatten()
    else:
        lengths, flat = np.ones(len(data), np.int32), data
    if not pa.types.is_integer(flat.type):
        raise ValueError(f"{path}: column {column.name!r} is {data.type}, not integer ids")
    if flat.null_count:
        raise ValueError(f"{path}: column {column.name!r} holds a null id")
    ids = np.asarray(flat.to_numpy(zero_copy_only=False))
    bad = (ids < 0) if ids.dtype.kind == "i" else (ids.astype(np.uint64) >= RESERVED_ID)
    if bad.any():
        record = int(np.searchsorted(np.cumsum(lengths), np.argmax(bad), side="right"))
        raise BadRecordError(path, first_row + 1 + record, f"column {column.name!r}: id "
                             f"{ids[np.argmax(bad)]} is not in [0, {int(RESERVED_ID)})")
    return ids.astype(np.uint64), lengths

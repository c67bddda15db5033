"""One table's four checkpoint files (ids, weights, state, last access), written from a
live table or from rows in memory, and read back chunk by chunk (see
:mod:`persia_py.servers.checkpoint` for the folder and :mod:`persia_py.servers.array_files`
for the files).

A table's description in ``ps-<r>.json`` says, beside its shapes and files, the rows per
chunk it was written in (``chunk_rows``) and each file's checksum (``sums``: 16 hex
digits); a description without them was written before checksums were kept, and its
files load unchecked.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np

from persia_py.ids.routing import replica_of
from persia_py.ops import safe_files
from persia_py.servers import row_types
from persia_py.servers.array_files import NpyReader, NpyWriter, chunk_rows
from persia_py.servers.row_stream import RowChunks, RowSink

__all__ = ["ARRAYS", "RowSource", "TableFiles", "check_sums", "row_chunks", "write_table"]

ARRAYS = {"ids": np.uint64, "weights": np.float32, "state": np.float32,
          "last_access": np.int64}
"""The files of one table and their element types (weights: float32 rows'; the
description's ``row_dtype`` says otherwise)."""
_SUM = re.compile(r"[0-9a-f]{16}")
_MAX_CHUNK_ROWS = 1 << 30


class RowSource(Protocol):
    """Rows handed to a sink slice by slice: a live ``EmbeddingTable``
    (:meth:`~persia_py.servers.storage.EmbeddingTable.stream_rows`), or rows made
    elsewhere (``benchmarks.disk_tier_process`` writes a 100M-row checkpoint so)."""

    dim: int
    state_width: int
    row_dtype: str

    def stream_rows(self, sink: RowSink) -> tuple[int, int]:
        """Every row to ``sink``; returns (how many, the clock after)."""
        ...


def write_table(dir_fd: int, prefix: str, rows: dict | RowSource) -> tuple[dict, int]:
    """Write the files ``<prefix>-<key>.npy`` of one table's ``rows`` (an export's dict
    of arrays, or a live table or other source, streamed: :class:`RowSource`) into
    ``dir_fd``, each fsync'd; returns (its description, bytes written)."""
    if isinstance(rows, dict):
        dim, width = int(rows["weights"].shape[1]), int(rows["state"].shape[1])
        row_dtype = rows.get("row_dtype", "float32")
    else:
        dim, width, row_dtype = rows.dim, rows.state_width, rows.row_dtype
    weight = np.dtype(row_types.numpy_dtype(row_dtype))
    shapes = {"ids": (), "weights": (dim,), "state": (width,), "last_access": ()}
    dtypes: dict[str, np.dtype] = {key: np.dtype(d) for key, d in ARRAYS.items()}
    dtypes["weights"] = weight
    per_chunk = chunk_rows(max(weight.itemsize * dim, 4 * width, 8))
    files = {key: f"{prefix}-{key}.npy" for key in ARRAYS}
    writers: dict[str, NpyWriter] = {}
    try:
        for key in ARRAYS:
            writers[key] = NpyWriter(dir_fd, files[key], dtypes[key], shapes[key], per_chunk)

        def sink(ids: np.ndarray, weights: np.ndarray, state: np.ndarray,
                 stamps: np.ndarray) -> None:
            for key, array in (("ids", ids), ("weights", weights), ("state", state),
                               ("last_access", stamps)):
                writers[key].append(array)

        if isinstance(rows, dict):
            sink(rows["ids"], rows["weights"], rows["state"], rows["last_access"])
            clock = int(rows["clock"])
        else:
            _, clock = rows.stream_rows(sink)
        num_rows = writers["ids"].num_rows
        done = {key: writers.pop(key).close() for key in ARRAYS}
    finally:
        for writer in writers.values():
            writer.abort()
    description = {"dim": dim, "state_width": width, "num_rows": num_rows,
                   "clock": int(clock), "files": files, "row_dtype": row_dtype,
                   "chunk_rows": per_chunk,
                   "sums": {key: f"{s:016x}" for key, (_, s) in done.items()}}
    return description, sum(size for size, _ in done.values())


def check_sums(table: dict, at: str) -> None:
    """CheckpointError unless ``table``'s ``chunk_rows`` and ``sums`` (if any) are well
    formed: both or neither, a multiple of 4096 rows, 16 hex digits per file."""
    if "sums" not in table and "chunk_rows" not in table:
        return
    per_chunk, sums = table.get("chunk_rows"), table.get("sums")
    if (not isinstance(per_chunk, int) or isinstance(per_chunk, bool)
            or not 0 < per_chunk <= _MAX_CHUNK_ROWS or per_chunk % 4096):
        raise safe_files.CheckpointError(f"{at}: 'chunk_rows' must be a positive multiple "
                                         "of 4096")
    if (not isinstance(sums, dict) or set(sums) != set(ARRAYS)
            or not all(isinstance(v, str) and _SUM.fullmatch(v) for v in sums.values())):
        raise safe_files.CheckpointError(f"{at}: 'sums' must give 16 hex digits for each of "
                                         f"{sorted(ARRAYS)}")


class TableFiles:
    """One replica's files of one table (``table`` as ``read_replica`` checked it), open,
    their headers checked against the description; the ids and stamps read whole, and
    with ``keep`` = (replica index, count) only the rows that route to that replica."""

    def __init__(self, dir_fd: int, table: dict, where: str, keep: tuple[int, int] | None,
                 stack: contextlib.ExitStack) -> None:
        n, dim, width = table["num_rows"], table["dim"], table["state_width"]
        shapes = {"ids": (n,), "weights": (n, dim), "state": (n, width), "last_access": (n,)}
        dtypes = {key: np.dtype(d) for key, d in ARRAYS.items()}
        dtypes["weights"] = np.dtype(row_types.numpy_dtype(table["row_dtype"]))
        self.where, self.row_dtype, self.clock = where, table["row_dtype"], table["clock"]
        sums = table.get("sums")
        self.sums = None if sums is None else {k: int(v, 16) for k, v in sums.items()}
        self.per_chunk = table.get("chunk_rows") or chunk_rows(
            max(dtypes["weights"].itemsize * dim, 4 * width, 8))
        self.readers: dict[str, NpyReader] = {}
        # One thread reads the four files in turn, a chunk of each ahead (shut down
        # first, files closed after: callbacks run last registered first).
        reads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="npy-read")
        try:
            for key, dtype in dtypes.items():
                reader = NpyReader(dir_fd, table["files"][key], field=f"{where}: files.{key}",
                                   reads=reads)
                stack.callback(reader.close)
                if reader.dtype != dtype or reader.shape != shapes[key]:
                    raise safe_files.CheckpointError(
                        f"{where}: {table['files'][key]} holds {reader.dtype} "
                        f"{reader.shape}, the description says {dtype.name} {shapes[key]}")
                self.readers[key] = reader
        finally:
            stack.callback(reads.shutdown, wait=True)
        self.ids = self._whole("ids")
        self.last_access = self._whole("last_access")
        self.mine: np.ndarray | None = None
        if keep is not None and keep[1] > 1:
            self.mine = np.flatnonzero(replica_of(self.ids, keep[1]) == keep[0])
            self.ids, self.last_access = self.ids[self.mine], self.last_access[self.mine]

    def _whole(self, key: str) -> np.ndarray:
        reader = self.readers[key]
        array = reader.read_all(self.per_chunk)
        self._check(key)
        return array

    def _check(self, key: str) -> None:
        self.readers[key].check_sum(None if self.sums is None else self.sums[key])

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray, bool]]:
        """``(weights, state, checked)`` of the kept rows, chunk by chunk (views: see
        :meth:`NpyReader.chunks`; ``checked``: the reader found every value finite, else
        not looked at); the files' sums are checked after the last."""
        n, width = self.readers["ids"].num_rows, self.readers["state"].shape[1]
        weight_reader, state_reader = self.readers["weights"], self.readers["state"]
        weights = weight_reader.chunks(self.per_chunk)
        state = (state_reader.chunks(self.per_chunk) if width else
                 ((a, np.zeros((min(self.per_chunk, n - a), 0), np.float32))
                  for a in range(0, n, self.per_chunk)))
        for (first, w), (_, s) in zip(weights, state):
            # A chunk the reader found non-finite is looked at again (and refused) by the
            # table, which names the rows.
            checked = bool(weight_reader.finite) and (not width or bool(state_reader.finite))
            if self.mine is not None:
                lo, hi = np.searchsorted(self.mine, [first, first + w.shape[0]])
                at = self.mine[lo:hi] - first
                w, s = w[at], s[at]
            yield w, s, checked
        self._check("weights")
        if width:
            self._check("state")


def row_chunks(parts: list[TableFiles]) -> RowChunks:
    """The rows of ``parts`` (one table's files of each replica) as one load."""

    def chunks() -> Iterator[tuple[int, np.ndarray, np.ndarray, str, bool]]:
        first = 0
        for part in parts:
            for weights, state, checked in part.chunks():
                yield first, weights, state, part.row_dtype, checked
                first += weights.shape[0]

    return RowChunks(ids=np.concatenate([p.ids for p in parts]),
                     last_access=np.concatenate([p.last_access for p in parts]),
                     clock=max(p.clock for p in parts), chunks=chunks,
                     row_dtypes=tuple(sorted({p.row_dtype for p in parts})))

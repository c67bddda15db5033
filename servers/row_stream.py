"""Every row of an ``EmbeddingTable`` streamed out to checkpoint files, and streamed back
into a fresh table, chunk by chunk (:meth:`EmbeddingTable.stream_rows`,
:meth:`EmbeddingTable.load_chunks`).

Why not :meth:`~EmbeddingTable.export_rows` and :meth:`~EmbeddingTable.import_rows`: they
hold whole copies of the rows, and on this VM the first touch of fresh memory costs more
than the disk (256 MB: 0.16-0.98 s to fault in, 0.04 s to write again). Streamed, the rows
go from a shard's arrays through a file's reused chunk buffer to the disk, and from the
disk through a reused buffer straight to their shard's arrays; only the arrays they live
in are ever faulted in.

* **Out** (:func:`stream_table`): each internal shard under its lock, its RAM rows in
  slices (views: no copy), then its disk tier's rows in the tier's sequential reads
  (:meth:`persia_py.servers.disk_tier.DiskTier.scan_chunks`). The lock is held while the
  sink writes them: a shard's lookups wait for its rows to reach the disk (a checkpoint
  is taken with no update in flight; docs/checkpoints.md).
* **In** (:func:`load_table`): the ids and stamps come whole (8 bytes a row each): every
  id's shard and row are planned and every shard's index built at once (sized for its
  rows: no growth), then weights and state come chunk by chunk, are checked (finite,
  shapes) and converted, and are scattered to their rows, or written to the shard's
  disk tier where a shard's share of RAM is full (its most recently used rows stay in
  RAM). Into a fresh table only: a failure half-way leaves it half-filled, so the caller
  drops it (``ParameterServer.load_state_dict`` builds new tables and swaps them in
  only when every row is in).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Protocol

import numpy as np
from numba import njit

from persia_py.ids.dedup import repeated_id
from persia_py.servers import kernels, row_types
from persia_py.servers.array_files import all_finite32
from persia_py.servers.row_transfer import check_stamps
from persia_py.servers.row_types import kernel_view

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from persia_py.servers.lookup_clock import LookupClock
    from persia_py.servers.shard import Shard

__all__ = ["RowChunks", "RowSink", "load_table", "stream_table"]

logger = logging.getLogger(__name__)

RowSink = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]
"""Takes ``(ids, weights, state, last_access)`` of some rows (views valid for the call):
uint64 ``[k]``, ``[k, dim]`` as stored, float32 ``[k, state width]``, int64 absolute
clock values ``[k]``."""

class EmbeddingTable(Protocol):
    """What this module reads of :class:`persia_py.servers.storage.EmbeddingTable` (which
    imports it)."""

    @property
    def dim(self) -> int: ...

    @property
    def state_width(self) -> int: ...

    @property
    def row_dtype(self) -> str: ...

    @property
    def _shards(self) -> list[Shard]: ...

    @property
    def _clock(self) -> LookupClock: ...

    @property
    def _executor(self) -> Executor | None: ...

    def _check_ids(self, ids: np.ndarray) -> np.ndarray: ...

    def _split_by_shard(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


_SLICE_ROWS = 1 << 16
"""Rows per slice of a shard's RAM rows handed to a sink."""


@dataclasses.dataclass
class RowChunks:
    """Rows to load into a fresh table: ids and stamps whole, weights and state in chunks."""

    ids: np.ndarray
    """uint64 ``[n]``, distinct."""
    last_access: np.ndarray
    """int64 ``[n]``: the absolute clock value each row was last used at, <= ``clock``."""
    clock: int
    """The table clock the rows were taken at."""
    chunks: Callable[[], Iterator[tuple[int, np.ndarray, np.ndarray, str, bool]]]
    """Yields ``(first, weights, state, row_dtype, checked)``: rows ``first .. first + k -
    1`` in order, covering ``0 .. n - 1``; weights ``[k, dim]`` stored as ``row_dtype``,
    state float32 ``[k, state width]``; views valid until the next chunk is asked for;
    ``checked``: every value of both is known finite (the reader checked them)."""
    row_dtypes: tuple[str, ...] = ("float32",)
    """The storage types the chunks' weights come in (for the log of conversions)."""


def stream_table(table: EmbeddingTable, sink: RowSink) -> int:
    """Hand every row of ``table`` (RAM and disk) to ``sink``, shard by shard, each under
    its lock; returns how many."""
    count = 0
    for shard in table._shards:
        with shard.lock:
            n = shard.size
            for a in range(0, n, _SLICE_ROWS):
                b = min(a + _SLICE_ROWS, n)
                sink(shard.ids[a:b], shard.weights[a:b], shard.state[a:b],
                     shard.clock.absolute(shard.last_access[a:b]))
            count += n
            if shard.tier is None or not shard.tier.num_rows:
                continue
            for ids, weights, state, stamps in shard.tier.scan_chunks():
                if stamps is None:  # no TTL: they left RAM as least recently used, the
                    # oldest unit (as export_rows)
                    stamps = shard.clock.absolute(np.zeros(ids.shape[0],
                                                           shard.last_access.dtype))
                sink(ids, weights, state, stamps)
                count += ids.shape[0]
    return count


def _finite(values: np.ndarray, row_dtype: str) -> bool:
    if row_dtype != "float32" or values.dtype != np.float32 or not values.flags.c_contiguous:
        return row_types.all_finite(values, row_dtype)
    return bool(all_finite32(values.reshape(-1).view(np.uint32)))


def _most_recent(stamps: np.ndarray, k: int) -> np.ndarray:
    """Positions (ascending) of the ``k`` largest ``stamps``, the first ones among equal
    stamps: what a stable sort by recency picks, by a radix select instead of a sort."""
    n = stamps.shape[0]
    if k >= n:
        return np.arange(n, dtype=np.int64)
    if k <= 0:
        return np.zeros(0, np.int64)
    return _most_recent_kernel(np.ascontiguousarray(stamps, np.int64), k)


@njit(cache=True, nogil=True)
def _most_recent_kernel(stamps: np.ndarray, k: int) -> np.ndarray:
    """:func:`_most_recent` for ``0 < k < len(stamps)``: the k-th largest stamp found
    by histograms of 2**16 buckets, each pass over the stamps in the bucket where it is
    narrowing the range by 16 bits (np.partition took a load's largest serial step);
    then one pass takes the stamps above it and the first of those equal to it."""
    n = stamps.shape[0]
    lo, hi = stamps[0], stamps[0]
    for i in range(n):
        lo, hi = min(lo, stamps[i]), max(hi, stamps[i])
    above = np.int64(0)  # stamps > hi (taken)
    counts = np.zeros(1 << 16, np.int64)
    wide = np.uint64(1 << 16)
    while lo < hi:
        span = np.uint64(hi) - np.uint64(lo)  # two's complement: exact for hi > lo
        shift = np.uint64(0)
        while (span >> shift) >= wide:
            shift += np.uint64(16)
        counts[:] = 0
        for i in range(n):
            v = stamps[i]
            if lo <= v <= hi:
                counts[np.int64((np.uint64(v) - np.uint64(lo)) >> shift)] += 1
        b = np.int64(span >> shift)
        while above + counts[b] < k:  # the bucket where the k-th largest is
            above += counts[b]
            b -= 1
        base = np.uint64(lo) + (np.uint64(b) << shift)
        top = min(np.uint64(hi) - base, (np.uint64(1) << shift) - np.uint64(1))
        lo, hi = np.int64(base), np.int64(base + top)
    ties = k - above  # of the stamps equal to the cut, the first ones
    out = np.empty(k, np.int64)
    j = 0
    for i in range(n):
        v = stamps[i]
        if v > lo or (v == lo and ties > 0):
            if v == lo:
                ties -= 1
            out[j] = i
            j += 1
    return out


def _plan_shard(shard: Shard, ids: np.ndarray, stamps: np.ndarray, clock: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """Plan the load of ``ids`` (this fresh shard's, in load order) and set their stamps:
    returns the row of each in the shard's arrays (-1: to its disk tier) and the ids in
    RAM (rows ``0..``), for its index (:func:`_index_shard`, in a thread meanwhile)."""
    n = ids.shape[0]
    ram_ids, ram_stamps = ids, stamps
    if n <= shard.share:
        rows = np.arange(n, dtype=np.int64)
    else:
        # The shard and its tier are empty (load_table): the rest fits if the tier can
        # take it; else check_fits raises, saying what does not fit (its probes of the
        # empty index and tier, over every id, are not worth making when it fits).
        if n > shard.share + (0 if shard.tier is None else shard.tier.capacity_rows):
            shard.check_fits(ids)
        # The most recently used rows in RAM, the others on disk (as store_rows).
        ram = _most_recent(stamps, shard.share)
        rows = np.full(n, -1, np.int64)
        rows[ram] = np.arange(ram.shape[0], dtype=np.int64)
        ram_ids, ram_stamps = ids[ram], stamps[ram]
        # The tier's index sized for its rows at once: grown step by step (as spills
        # grow it) it would be rehashed some 50 times on the way to millions of rows.
        assert shard.tier is not None
        shard.tier.index.reserve(n - ram.shape[0])
    n_ram = ram_ids.shape[0]
    shard._reserve(n_ram)
    shard.last_access[:n_ram] = shard.clock.relative(ram_stamps, clock, shard.last_access[:0])
    shard.size = n_ram
    return rows, ram_ids


def _index_shard(shard: Shard, ids: np.ndarray, every: np.ndarray | None) -> None:
    """Build ``shard``'s index of ``ids`` at rows ``0..`` at once, sized for them (no
    growth; writes each id to ``shard.ids``); a repeated id is a ValueError, among
    ``every`` id of the shard too where some go to its disk tier (where repeats would
    be stored twice: the load fails, the table is dropped). Without the shard's lock:
    the table is not shared yet, and the rows stored meanwhile touch neither the index
    nor ``shard.ids``."""
    if every is not None:
        repeat = repeated_id(every)
        if repeat is not None:
            raise ValueError(f"ids are not distinct: id {repeat} repeats")
    try:
        shard.index.rebuild(ids, np.arange(ids.shape[0], dtype=np.int64), room=ids.shape[0])
    except ValueError as exc:
        raise ValueError(f"ids are not distinct: {exc}") from None


def load_table(table: EmbeddingTable, rows: RowChunks, name: str = "") -> int:
    """Store ``rows`` into ``table`` (named ``name`` in the log), which holds none yet;
    returns how many. ValueError says what is wrong (as
    :meth:`EmbeddingTable.import_rows` would); the table is then half-filled and must be
    dropped."""
    if any(s.size or (s.tier is not None and s.tier.num_rows) for s in table._shards):
        raise ValueError("load_chunks: the table must be empty (a fresh one)")
    ids = table._check_ids(rows.ids)
    n = ids.shape[0]
    stamps, clock = check_stamps(rows.last_access, rows.clock, n)
    clock = max(clock, table._clock.current())
    one = len(table._shards) == 1  # every row its: no routing, no copies of ids and stamps
    order, bounds = ((np.arange(n, dtype=np.int64), np.array([0, n])) if one
                     else table._split_by_shard(ids))
    plans, in_ram = [], []  # per shard: its rows' positions in the load (ascending), rows
    for k, shard in enumerate(table._shards):
        pos = order[bounds[k]:bounds[k + 1]]
        shard_ids = ids if one else ids[pos]
        with shard.lock:
            shard_rows, ram_ids = _plan_shard(shard, shard_ids, stamps if one else stamps[pos],
                                              clock)
        plans.append((pos, shard_rows))
        in_ram.append((ram_ids, None if ram_ids.shape[0] == pos.shape[0] else shard_ids))
    # The indexes are built, and the ids going to disk checked, in a thread while the rows
    # stream in (numba and sorts: no GIL); the tiers index the rows they take in another.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="load-index") as pool, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="load-tier-index") as tiers:
        futures = [pool.submit(_index_shard, shard, *ram)
                   for shard, ram in zip(table._shards, in_ram)]
        try:
            done = _store_chunks(table, ids, stamps, rows, plans, tiers)
        finally:
            wait(futures)
        for future in futures:
            future.result()
    if done != n:
        raise ValueError(f"weights and state came for {done} rows of {n} ids")
    table._clock.advance_to(clock)
    others = [d for d in rows.row_dtypes if d != table.row_dtype]
    if others and n:
        logger.info("table %r: %d rows stored as %s were converted once to the table's %s",
                    name, n, " or ".join(others), table.row_dtype)
    return n


def _store_chunks(table: EmbeddingTable, ids: np.ndarray, stamps: np.ndarray,
                  rows: RowChunks, plans: list[tuple[np.ndarray, np.ndarray]],
                  tiers: Executor) -> int:
    """Check, convert and store every chunk of ``rows`` (the tiers index theirs in
    ``tiers``); returns the rows they held."""
    n = ids.shape[0]
    done = 0
    for first, weights, state, row_dtype, checked in rows.chunks():
        k = weights.shape[0]
        where = f"rows {first}..{first + k - 1}"
        if first != done:
            raise ValueError(f"{where}: chunks must follow each other (expected row {done})")
        if first + k > n:
            raise ValueError(f"{where}: past the {n} ids")
        _check_chunk(table, weights, state, row_dtype, where, checked)
        weights = np.ascontiguousarray(row_types.convert(weights, row_dtype, table.row_dtype))
        state = np.ascontiguousarray(state)
        parts = []
        for shard, (pos, shard_rows) in zip(table._shards, plans):
            lo, hi = np.searchsorted(pos, (first, first + k))
            if hi > lo:
                parts.append((shard, ids, stamps, pos[lo:hi], shard_rows[lo:hi], first,
                              weights, state, tiers))
        executor = table._executor
        if executor is None or len(parts) < 2:
            for part in parts:
                _store_part(*part)
        else:  # the shards' threads, as a big batch (numba, no GIL)
            futures = [executor.submit(_store_part, *part) for part in parts]
            wait(futures)
            for future in futures:
                future.result()
        done = first + k
    for shard in table._shards:  # the tiers' last appends are on disk and indexed (or
        # raise here)
        if shard.tier is not None:
            shard.tier.flush()
    return done


def _store_part(shard: Shard, ids: np.ndarray, stamps: np.ndarray, pos: np.ndarray,
                rows: np.ndarray, first: int, weights: np.ndarray, state: np.ndarray,
                tiers: Executor) -> None:
    """Rows ``pos`` of the load (of the chunk from row ``first``) to their ``rows`` of
    ``shard`` (-1: its disk tier)."""
    at = pos - first
    ram = rows >= 0
    everything = bool(ram.all())
    with shard.lock:
        to, at_ram = (rows, at) if everything else (rows[ram], at[ram])
        kernels.scatter_rows(kernel_view(shard.weights), to, kernel_view(weights), at_ram)
        kernels.scatter_rows(shard.state, to, state, at_ram)
        if everything:
            return
        disk = at[~ram]
        assert shard.tier is not None
        if disk[-1] - disk[0] + 1 == disk.shape[0]:  # a run (the usual: RAM's rows are
            # dumped first): views, not copies into fresh memory
            a, b = int(disk[0]), int(disk[-1]) + 1
            shard.tier.append(ids[first + a:first + b], weights[a:b], state[a:b],
                              stamps[first + a:first + b], indexer=tiers)
        else:
            shard.tier.append(ids[pos[~ram]], np.take(weights, disk, axis=0),
                              np.take(state, disk, axis=0), stamps[pos[~ram]], indexer=tiers)


def _check_chunk(table: EmbeddingTable, weights: np.ndarray, state: np.ndarray,
                 row_dtype: str, where: str, checked: bool) -> None:
    k = weights.shape[0]
    want = row_types.numpy_dtype(row_types.check_row_dtype(row_dtype))
    if weights.dtype != want or weights.shape != (k, table.dim):
        raise ValueError(f"{where}: weights must be {want} of shape ({k}, {table.dim}), got "
                         f"{weights.dtype} {weights.shape}")
    if state.dtype != np.float32 or state.shape != (k, table.state_width):
        raise ValueError(f"{where}: state must be float32 of shape ({k}, "
                         f"{table.state_width}), got {state.dtype} {state.shape}")
    if checked:
        return
    if not _finite(weights, row_dtype):
        raise ValueError(f"{where}: weights contain NaN or infinite values")
    if not _finite(state, "float32"):
        raise ValueError(f"{where}: state contain NaN or infinite values")

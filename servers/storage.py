"""``EmbeddingTable``: the rows of one embedding slot on one parameter-server replica.

The table is split into internal shards (chosen by ``shard_of``), each with its own
hash index, lock and contiguous growable arrays: weights ``(rows, dim)``, optimizer
state ``(rows, width)``, the id of each row, and a logical access clock for LRU
eviction. Rows are dense (``0..size-1``), so gathers and scatters are plain fancy
indexing and eviction compacts by moving surviving tail rows into the holes.

Batches are split by shard and, when there are several shards and the batch is big
enough, the shards are worked on in parallel threads: the hash kernels release the
GIL and numpy releases it for the large gathers and arithmetic.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Self

import numpy as np
from numba import njit

from persia_py.routing import RESERVED_ID, shard_of
from persia_py.servers.hash_index import HashIndex
from persia_py.servers.initializer import initial_rows
from persia_py.servers.optimizers import (
    OptimizerConfig,
    apply_update,
    initial_state,
    state_width,
)

_INITIAL_ROWS = 1024
# Below this many ids, handing shards to worker threads costs more than it saves.
_PARALLEL_MIN_IDS = 8192
# Evict at least this fraction of a shard's share at once, so the O(share) index
# rebuild after an eviction is amortized over many inserts.
_EVICT_FRACTION = 16


@njit(cache=True, nogil=True)
def _group_by_shard(owner: np.ndarray, num_shards: int) -> tuple[np.ndarray, np.ndarray]:
    """Counting sort of positions by owner: O(n), unlike the argsort in ``split_by``.

    Same contract as ``persia_py.routing.split_by``: positions of shard ``k`` are
    ``order[bounds[k]:bounds[k + 1]]``, in their original relative order.
    """
    bounds = np.zeros(num_shards + 1, np.int64)
    for i in range(owner.shape[0]):
        bounds[owner[i] + 1] += 1
    for k in range(num_shards):
        bounds[k + 1] += bounds[k]
    fill = bounds[:-1].copy()
    order = np.empty(owner.shape[0], np.int64)
    for i in range(owner.shape[0]):
        k = owner[i]
        order[fill[k]] = i
        fill[k] += 1
    return order, bounds


class _Shard:
    """One internal shard; ``lookup`` and ``update`` hold ``lock`` throughout."""

    def __init__(self, table: EmbeddingTable, share: int) -> None:
        self.table = table
        self.share = share
        self.lock = threading.Lock()
        self.index = HashIndex()
        rows = min(share, _INITIAL_ROWS)
        self.ids = np.empty(rows, dtype=np.uint64)
        self.weights = np.empty((rows, table.dim), dtype=np.float32)
        self.state = np.empty((rows, table.state_width), dtype=np.float32)
        self.last_access = np.zeros(rows, dtype=np.int64)
        self.size = 0
        self.hits = self.misses = self.inserted = self.evicted = 0

    def nbytes(self) -> int:
        arrays = (self.ids, self.weights, self.state, self.last_access)
        return sum(a.nbytes for a in arrays) + self.index.nbytes

    def lookup(self, ids: np.ndarray, insert: bool, tick: int) -> np.ndarray:
        with self.lock:
            rows = self.index.find(ids)
            found = rows >= 0
            n_found = int(np.count_nonzero(found))
            self.hits += n_found
            self.misses += ids.shape[0] - n_found
            if n_found < ids.shape[0] and not insert:
                hit_rows = rows[found]
                self.last_access[hit_rows] = tick
                out = np.zeros((ids.shape[0], self.table.dim), dtype=np.float32)
                out[found] = np.take(self.weights, hit_rows, axis=0)
                return out
            if n_found < ids.shape[0]:
                rows = self._insert_missing(ids, rows, found, tick)
            self.last_access[rows] = tick
            return np.take(self.weights, rows, axis=0)

    def _insert_missing(self, ids: np.ndarray, rows: np.ndarray, found: np.ndarray,
                        tick: int) -> np.ndarray:
        hit_rows = rows[found]
        # Stamping the hits first shields them from the eviction below.
        self.last_access[hit_rows] = tick
        missing = ~found
        new_ids, inverse = np.unique(ids[missing], return_inverse=True)
        n_new = new_ids.shape[0]
        overflow = self.size + n_new - self.share
        if overflow > 0:
            remap = self._evict(overflow, n_new, tick)
            rows[found] = remap[hit_rows]
        self._reserve(self.size + n_new)
        start, end = self.size, self.size + n_new
        new_rows, is_new = self.index.find_or_insert(new_ids, start)
        assert bool(is_new.all()), "an id missing a moment ago was found on insert"
        table = self.table
        self.ids[start:end] = new_ids
        self.weights[start:end] = initial_rows(
            new_ids, table.dim, table.init_lower, table.init_upper, table.seed)
        self.state[start:end] = initial_state(table.optimizer, n_new, table.dim)
        self.last_access[start:end] = tick
        self.size = end
        self.inserted += n_new
        rows[missing] = new_rows[inverse]
        return rows

    def _evict(self, overflow: int, n_new: int, tick: int) -> np.ndarray:
        """Drop at least ``overflow`` least-recently-used rows; returns old->new rows."""
        size = self.size
        stamps = self.last_access[:size]
        candidates = int(np.count_nonzero(stamps < tick))
        if candidates < overflow:
            raise ValueError(
                f"one batch needs {n_new} new rows plus {size - candidates} rows it "
                f"touches in one internal shard, over its share of {self.share} rows; "
                f"raise capacity (now {self.table.capacity}) or send smaller batches")
        count = min(max(overflow, self.share // _EVICT_FRACTION), candidates)
        victims = np.argpartition(stamps, count - 1)[:count]
        keep = np.ones(size, dtype=np.bool_)
        keep[victims] = False
        n_keep = size - count
        # Fill holes below n_keep with survivors from above it: moves only ``count``
        # rows instead of shifting everything down.
        holes = np.sort(victims[victims < n_keep])
        movers = np.flatnonzero(keep[n_keep:]) + n_keep
        for array in (self.ids, self.weights, self.state, self.last_access):
            array[holes] = array[movers]
        remap = np.arange(size, dtype=np.int64)
        remap[victims] = -1
        remap[movers] = holes
        self.size = n_keep
        self.evicted += count
        self.index.rebuild(self.ids[:n_keep], np.arange(n_keep, dtype=np.int64))
        return remap

    def _reserve(self, rows: int) -> None:
        capacity = self.weights.shape[0]
        if rows <= capacity:
            return
        new_capacity = min(max(rows, 2 * capacity), self.share)
        assert new_capacity >= rows, "reserve past the shard's share"
        for name in ("ids", "weights", "state", "last_access"):
            old = getattr(self, name)
            new = np.empty((new_capacity, *old.shape[1:]), dtype=old.dtype)
            new[: self.size] = old[: self.size]
            setattr(self, name, new)

    def update(self, ids: np.ndarray, grads: np.ndarray, tick: int) -> int:
        with self.lock:
            rows = self.index.find(ids)
            found = rows >= 0
            if not found.all():
                rows, grads = rows[found], grads[found]
            if rows.shape[0] == 0:
                return 0
            table = self.table
            weights, state = apply_update(
                table.optimizer, np.take(self.weights, rows, axis=0),
                np.take(self.state, rows, axis=0), grads)
            if table.weight_bound is not None:
                np.clip(weights, -table.weight_bound, table.weight_bound, out=weights)
            self.weights[rows] = weights
            self.state[rows] = state
            self.last_access[rows] = tick
            return rows.shape[0]


def _check_int(name: str, value: object, minimum: int) -> int:
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if not ok or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class EmbeddingTable:
    """Embedding rows of one slot with lazy insertion, row-wise optimizer and LRU cap."""

    def __init__(self, *, dim: int, optimizer: OptimizerConfig, init_lower: float = -0.01,
                 init_upper: float = 0.01, seed: int = 0, num_shards: int = 1,
                 capacity: int = 1_000_000, weight_bound: float | None = None) -> None:
        self.dim = _check_int("dim", dim, 1)
        self.num_shards = _check_int("num_shards", num_shards, 1)
        self.capacity = _check_int("capacity", capacity, 1)
        self.seed = _check_int("seed", seed, 0)
        self.state_width = state_width(optimizer, dim)  # rejects non-config objects
        self.optimizer = optimizer
        if not (math.isfinite(init_lower) and math.isfinite(init_upper)
                and init_lower <= init_upper):
            raise ValueError("init_lower and init_upper must be finite with "
                             f"init_lower <= init_upper, got {init_lower}, {init_upper}")
        self.init_lower, self.init_upper = float(init_lower), float(init_upper)
        if weight_bound is not None and not (math.isfinite(weight_bound) and weight_bound > 0):
            raise ValueError(f"weight_bound must be None or a finite number > 0, "
                             f"got {weight_bound!r}")
        self.weight_bound = None if weight_bound is None else float(weight_bound)
        share = -(-capacity // num_shards)
        self._shards = [_Shard(self, share) for _ in range(num_shards)]
        self._clock = 0
        self._clock_lock = threading.Lock()
        self._executor = None
        if num_shards > 1:
            self._executor = ThreadPoolExecutor(
                max_workers=min(num_shards, os.cpu_count() or 1),
                thread_name_prefix="embedding-shard")

    def close(self) -> None:
        """Stop the shard worker threads; the table stays usable, serially."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _tick(self) -> int:
        with self._clock_lock:
            self._clock += 1
            return self._clock

    def _check_ids(self, ids: np.ndarray) -> np.ndarray:
        if not isinstance(ids, np.ndarray) or ids.dtype != np.uint64 or ids.ndim != 1:
            got = (f"dtype {ids.dtype}, shape {ids.shape}" if isinstance(ids, np.ndarray)
                   else type(ids).__name__)
            raise ValueError(f"ids must be a 1-D numpy array of dtype uint64, got {got}")
        if bool((ids == RESERVED_ID).any()):
            raise ValueError("ids contain the reserved id 2**64-1, which cannot be stored")
        return np.ascontiguousarray(ids)

    def _per_shard(self, ids: np.ndarray,
                   work: Callable[[_Shard, np.ndarray | slice], None]) -> None:
        """Call ``work(shard, positions)`` for each shard owning some of ``ids``.

        A failure in one shard does not undo the others' work; the first error is
        re-raised once every shard has finished.
        """
        if self.num_shards == 1:
            work(self._shards[0], slice(None))
            return
        order, bounds = _group_by_shard(shard_of(ids, self.num_shards), self.num_shards)
        parts = [(self._shards[k], order[bounds[k]:bounds[k + 1]])
                 for k in range(self.num_shards) if bounds[k + 1] > bounds[k]]
        executor = self._executor
        if executor is None or len(parts) < 2 or ids.shape[0] < _PARALLEL_MIN_IDS:
            for shard, positions in parts:
                work(shard, positions)
            return
        futures = [executor.submit(work, shard, positions) for shard, positions in parts]
        wait(futures)
        for future in futures:
            future.result()

    def lookup(self, ids: np.ndarray, insert: bool) -> np.ndarray:
        """Rows for ``ids`` as float32 ``(len(ids), dim)``; repeats are allowed.

        With ``insert`` missing ids are created (deterministic initial values, fresh
        optimizer state), evicting least-recently-used rows if the shard is full;
        without it they read as zero rows and nothing is inserted. Raises ValueError
        if one internal shard cannot fit the batch's new ids even after evicting
        every row the batch does not touch.
        """
        ids = self._check_ids(ids)
        tick = self._tick()
        if self.num_shards == 1:  # skip the scatter into a second output array
            return self._shards[0].lookup(ids, bool(insert), tick)
        out = np.empty((ids.shape[0], self.dim), dtype=np.float32)

        def work(shard: _Shard, positions: np.ndarray | slice) -> None:
            out[positions] = shard.lookup(ids[positions], bool(insert), tick)

        self._per_shard(ids, work)
        return out

    def update(self, ids: np.ndarray, grads: np.ndarray) -> int:
        """Apply one optimizer step; returns how many distinct rows were updated.

        Gradients of repeated ids are summed first. Ids not in the table (never
        looked up with insert, or evicted since) are skipped.
        """
        ids = self._check_ids(ids)
        if not isinstance(grads, np.ndarray) or grads.shape != (ids.shape[0], self.dim):
            got = grads.shape if isinstance(grads, np.ndarray) else type(grads).__name__
            raise ValueError(f"grads must be a numpy array of shape "
                             f"({ids.shape[0]}, {self.dim}), got {got}")
        if grads.dtype.kind != "f":
            raise ValueError(f"grads must have a floating dtype, got {grads.dtype}")
        grads = grads.astype(np.float32, copy=False)
        if not bool(np.isfinite(grads).all()):
            raise ValueError("grads contain NaN or infinite values; nothing was updated")
        if ids.shape[0] == 0:
            return 0
        order = np.argsort(ids)
        sorted_ids = ids[order]
        first = np.empty(sorted_ids.shape[0], dtype=np.bool_)
        first[0] = True
        np.not_equal(sorted_ids[1:], sorted_ids[:-1], out=first[1:])
        starts = np.flatnonzero(first)
        unique_ids = sorted_ids[starts]
        summed = np.take(grads, order, axis=0)
        if starts.shape[0] < sorted_ids.shape[0]:
            summed = np.add.reduceat(summed, starts, axis=0)
        tick = self._tick()
        counts: list[int] = []

        def work(shard: _Shard, positions: np.ndarray | slice) -> None:
            counts.append(shard.update(unique_ids[positions], summed[positions], tick))

        self._per_shard(unique_ids, work)
        return sum(counts)

    def export_rows(self) -> dict[str, np.ndarray | int]:
        """Copies of every stored row, for checkpoints: ``ids`` (uint64 [n]), ``weights``
        (float32 [n, dim]), ``state`` (float32 [n, state_width]), ``last_access`` (int64
        [n], the LRU clock) and ``clock`` (int). Each shard is copied under its lock."""
        parts = []
        for shard in self._shards:
            with shard.lock:
                n = shard.size
                parts.append((shard.ids[:n].copy(), shard.weights[:n].copy(),
                              shard.state[:n].copy(), shard.last_access[:n].copy()))
        ids, weights, state, stamps = (np.concatenate(p) for p in zip(*parts))
        with self._clock_lock:
            clock = self._clock
        return {"ids": ids, "weights": weights, "state": state, "last_access": stamps,
                "clock": clock}

    def import_rows(self, ids: np.ndarray, weights: np.ndarray, state: np.ndarray,
                    last_access: np.ndarray | None = None, clock: int = 0) -> None:
        """Store rows as given (distinct ids; stored ones are overwritten), e.g. from a
        checkpoint. Raises ValueError if a shard would exceed its share of capacity."""
        ids = self._check_ids(ids)
        n = ids.shape[0]
        if weights.shape != (n, self.dim) or state.shape != (n, self.state_width):
            raise ValueError(f"rows of shape {weights.shape} / state {state.shape} do not fit "
                             f"{n} ids of dim {self.dim}, state width {self.state_width}")
        stamps = (np.zeros(n, np.int64) if last_access is None
                  else np.asarray(last_access, dtype=np.int64))
        with self._clock_lock:
            self._clock = max(self._clock, int(clock), int(stamps.max(initial=0)))
        order, bounds = _group_by_shard(shard_of(ids, self.num_shards), self.num_shards)
        for k, shard in enumerate(self._shards):
            pos = order[bounds[k]:bounds[k + 1]]
            with shard.lock:
                rows = shard.index.find(ids[pos])
                new = rows < 0
                n_new = int(np.count_nonzero(new))
                if shard.size + n_new > shard.share:
                    raise ValueError(f"{shard.size + n_new} rows do not fit one internal "
                                     f"shard's share of {shard.share} (capacity "
                                     f"{self.capacity}); raise capacity")
                shard._reserve(shard.size + n_new)
                new_rows, _ = shard.index.find_or_insert(ids[pos][new], shard.size)
                rows[new] = new_rows
                shard.size += n_new
                shard.ids[rows] = ids[pos]
                shard.weights[rows] = weights[pos]
                shard.state[rows] = state[pos]
                shard.last_access[rows] = stamps[pos]

    @property
    def num_entries(self) -> int:
        """Rows currently stored, over all internal shards."""
        return sum(shard.size for shard in self._shards)

    def stats(self) -> dict[str, int]:
        """Counters over all shards.

        ``hits``/``misses`` count looked-up ids (repeats included) found/not found,
        ``inserted``/``evicted`` count rows, ``bytes`` is the resident array size.
        """
        totals = dict.fromkeys(("entries", "bytes", "hits", "misses", "inserted", "evicted"), 0)
        for shard in self._shards:
            with shard.lock:
                totals["entries"] += shard.size
                totals["bytes"] += shard.nbytes()
                totals["hits"] += shard.hits
                totals["misses"] += shard.misses
                totals["inserted"] += shard.inserted
                totals["evicted"] += shard.evicted
        return totals

"""``EmbeddingTable``: the rows of one embedding slot on one parameter-server replica.

The table is split into internal shards (chosen by a keyed hash), each with its own
hash index, lock and contiguous growable arrays: weights ``(rows, dim)`` (float32,
float16 or bfloat16 bits: :mod:`persia_py.servers.row_types`), optimizer
state ``(rows, width)``, the id of each row, and a logical access clock for LRU
eviction and expiry. Rows are dense (``0..size-1``); lookups and optimizer steps are
fused numba kernels (:mod:`persia_py.servers.kernels`) that read and write each id's
row in place, and eviction compacts by moving surviving tail rows into the holes.

Per-table policies, all optional: admission of new ids (a probability, deterministic
per ``(id, seed, step)``, and a minimum number of sightings counted in a count-min
sketch), expiry of rows unseen for a number of steps or seconds, and a capacity past
which the least recently used rows are evicted.

Batches are split by shard and, when there are several shards and the batch is big
enough, the shards are worked on in parallel threads: every kernel releases the GIL.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import numpy.typing as npt

from persia_py.config.table_policy import TablePolicy, check_init_bounds, check_weight_bound
from persia_py.ids.dedup import unique_in_order
from persia_py.ids.hashing import ADMIT_SALT, ROUNDING_SALT, HashKey, keyed_buckets, mix64
from persia_py.ids.routing import RESERVED_ID, split_by
from persia_py.servers import kernels, memory, row_types
from persia_py.servers.access_clock import STAMP_DTYPE, AccessClock
from persia_py.servers.hash_index import HashIndex
from persia_py.servers.initializer import initial_rows
from persia_py.servers.optimizers import (
    AdagradConfig,
    AdamConfig,
    OptimizerConfig,
    SGDConfig,
    initial_state,
    state_width,
)
from persia_py.servers.row_types import kernel_view
from persia_py.wire.codec import cast_float

_INITIAL_ROWS = 1024
MAX_CLOCK = 2**62
"""Largest LRU clock value a table accepts from outside (import_rows): far from int64's
end, so that counting on from it never overflows."""
# Below this many ids, handing shards to worker threads costs more than it saves.
_PARALLEL_MIN_IDS = 8192
# Evict at least this fraction of a shard's share at once, so the O(share) index
# rebuild after an eviction is amortized over many inserts.
_EVICT_FRACTION = 16
# Expiry sweeps run once 1/_EXPIRE_LAG of the expiry period has passed since the last
# one, so a row goes at most that much later than its period says.
_EXPIRE_LAG = 16
_SKETCH_DEPTH = 4
_SKETCH_MIN_WIDTH = 1 << 12
_SKETCH_MAX_WIDTH = 1 << 22
# Halve every counter after this many sightings per sketch column, so that counts
# reflect recent traffic and the sketch never saturates.
_SKETCH_DECAY_PER_COLUMN = 8


class _Shard:
    """One internal shard; every method that reads or writes rows holds ``lock``."""

    def __init__(self, table: EmbeddingTable, share: int) -> None:
        self.table = table
        self.share = share
        self.lock = threading.Lock()
        # The whole share as address space when the OS allows: rows never move to grow.
        shapes = {"ids": (share,), "weights": (share, table.dim),
                  "state": (share, table.state_width), "last_access": (share,)}
        dtypes = dict(_DTYPES, weights=row_types.numpy_dtype(table.row_dtype))
        arrays = {name: memory.reserve(shape, dtypes[name]) for name, shape in shapes.items()}
        self.reserved = all(a is not None for a in arrays.values())
        if not self.reserved:
            rows = min(share, _INITIAL_ROWS)
            arrays = {name: memory.empty((rows, *shape[1:]), dtypes[name])
                      for name, shape in shapes.items()}
        self.ids, self.weights = arrays["ids"], arrays["weights"]
        self.state, self.last_access = arrays["state"], arrays["last_access"]
        self.index = HashIndex(row_ids=self.ids)
        self.clock = AccessClock()
        self.high_water = 0
        """Most rows ever in use: with reserved arrays, the rows whose pages are resident."""
        self.size = 0
        self.hits = self.misses = self.inserted = self.evicted = 0
        self.admitted = self.rejected = self.expired = 0
        self.sketch: np.ndarray | None = None
        self.sightings = 0
        self.changed: list[np.ndarray] | None = None
        """Ids inserted or updated since the last ``take_changes`` (None: not tracked)."""
        self.num_changed = 0
        self.removed: list[np.ndarray] = []
        """Ids evicted or expired since the last ``take_changes`` (kept while tracking)."""
        self.num_removed = 0
        if table.min_occurrences > 1:
            width = 1 << max(share - 1, 1).bit_length()
            width = min(max(width, _SKETCH_MIN_WIDTH), _SKETCH_MAX_WIDTH)
            self.sketch = np.zeros((_SKETCH_DEPTH, width), dtype=np.uint8)
            # Secret salts: with public ones, ids could be crafted to share counters and
            # reach ``min_occurrences`` sooner (no slowdown: the sketch never probes).
            self.sketch_salts = HashKey.random(_SKETCH_DEPTH).words

    def nbytes(self) -> int:
        arrays = (self.ids, self.weights, self.state, self.last_access)
        rows = self.high_water if self.reserved else self.weights.shape[0]
        row_bytes = sum(a.itemsize * (a.size // max(a.shape[0], 1)) for a in arrays)
        sketch = 0 if self.sketch is None else self.sketch.nbytes
        return rows * row_bytes + self.index.nbytes + sketch

    def lookup(self, ids: np.ndarray, insert: bool, tick: int, out: np.ndarray,
               positions: np.ndarray | None) -> None:
        """Write the rows of ``ids`` to ``out`` (at ``positions``, or ``0..n-1``): their
        bits when ``out`` has the weights' type, else widened to float32."""
        weights = kernel_view(self.weights)
        same = out.dtype == self.weights.dtype
        out = kernel_view(out)
        with self.lock:
            stamp = self.clock.stamp(tick, self.last_access[:self.size])
            if same:  # probe and copy in one pass
                rows = self.index.find_gather(ids, weights, out, self.last_access, stamp,
                                              positions)
            else:
                rows = self.index.find(ids)
                at = np.arange(ids.shape[0]) if positions is None else positions
                kernels.gather_rows_at(weights, rows, at, out, self.last_access, stamp)
            num_missing = int(np.count_nonzero(rows < 0))
            self.hits += ids.shape[0] - num_missing
            self.misses += num_missing
            if num_missing and insert:
                # Rows found are copied already (an eviction below never takes them:
                # they carry this tick); copy the new ones.
                new = np.flatnonzero(rows < 0)
                rows = self._insert_missing(ids, rows, tick, stamp)
                at = new if positions is None else positions[new]
                kernels.gather_rows_at(weights, rows[new], at, out, self.last_access, stamp)

    def _admit(self, new_ids: np.ndarray, tick: int) -> np.ndarray:
        """Which of these distinct absent ids may be stored now (bool mask)."""
        table = self.table
        keep = np.ones(new_ids.shape[0], dtype=np.bool_)
        if self.sketch is not None:
            keep = kernels.count_sightings(self.sketch, self.sketch_salts, new_ids,
                                           table.min_occurrences)
            self.sightings += new_ids.shape[0]
            if self.sightings >= _SKETCH_DECAY_PER_COLUMN * self.sketch.shape[1]:
                self.sketch >>= 1
                self.sightings = 0
        if table.admit_probability < 1.0:
            draw = mix64(mix64(new_ids, ADMIT_SALT ^ np.uint64(table.seed)), np.uint64(tick))
            unit = (draw >> np.uint64(11)).astype(np.float64) * 2.0**-53
            keep &= unit < table.admit_probability
        return keep

    def _insert_missing(self, ids: np.ndarray, rows: np.ndarray, tick: int, stamp: int
                        ) -> np.ndarray:
        missing = rows < 0
        found = ~missing
        hit_rows = rows[found]
        # Stamping the hits first shields them from the eviction below.
        self.last_access[hit_rows] = stamp
        new_ids, inverse = unique_in_order(ids[missing])
        keep = self._admit(new_ids, tick)
        admitted = new_ids if keep.all() else new_ids[keep]
        n_new = admitted.shape[0]
        self.rejected += new_ids.shape[0] - n_new
        self.admitted += n_new
        if n_new == 0:
            return rows
        overflow = self.size + n_new - self.share
        if overflow > 0:
            remap = self._evict(overflow, n_new, stamp)
            rows[found] = remap[hit_rows]
        self._reserve(self.size + n_new)
        start, end = self.size, self.size + n_new
        new_rows, is_new = self.index.find_or_insert(admitted, start)
        assert bool(is_new.all()), "an id missing a moment ago was found on insert"
        table = self.table
        initial = initial_rows(admitted, table.dim, table.init_lower, table.init_upper,
                               table.seed, out=(self.weights[start:end]
                                                if table.row_dtype == "float32" else None))
        if table.row_dtype != "float32":
            row_types.to_stored(initial, table.row_dtype, out=self.weights[start:end])
        self.state[start:end] = initial_state(table.optimizer, 1, table.dim)
        self.last_access[start:end] = stamp
        self.size = end
        self.inserted += n_new
        self._log_changes(admitted)
        if n_new < new_ids.shape[0]:
            all_rows = np.full(new_ids.shape[0], -1, dtype=np.int64)
            all_rows[keep] = new_rows
            new_rows = all_rows
        rows[missing] = new_rows[inverse]
        return rows

    def _evict(self, overflow: int, n_new: int, stamp: int) -> np.ndarray:
        """Drop at least ``overflow`` least-recently-used rows; returns old->new rows."""
        size = self.size
        stamps = self.last_access[:size]
        candidates = int(np.count_nonzero(stamps < stamp))
        if candidates < overflow:
            raise ValueError(
                f"one batch needs {n_new} new rows plus {size - candidates} rows it "
                f"touches in one internal shard, over its share of {self.share} rows; "
                f"raise capacity (now {self.table.capacity}) or send smaller batches")
        count = min(max(overflow, self.share // _EVICT_FRACTION), candidates)
        victims = np.argpartition(stamps, count - 1)[:count]
        self.evicted += count
        return self._remove(victims)

    def expire(self, cutoff: int) -> None:
        """Remove every row last touched before clock value ``cutoff``."""
        with self.lock:
            victims = np.flatnonzero(self.last_access[:self.size]
                                     < self.clock.cutoff(cutoff))
            if victims.shape[0]:
                self.expired += victims.shape[0]
                self._remove(victims)

    def _remove(self, victims: np.ndarray) -> np.ndarray:
        """Delete rows ``victims`` (distinct), compacting; returns old -> new row (-1: gone)."""
        size = self.size
        count = victims.shape[0]
        gone = self.ids[victims].copy() if self.changed is not None else None
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
        self.index.rebuild(self.ids[:n_keep], np.arange(n_keep, dtype=np.int64), room=size)
        if gone is not None:  # deletions travel in increments too
            self._log_removed(gone)
        return remap

    def _reserve(self, rows: int) -> None:
        self.high_water = max(self.high_water, rows)
        capacity = self.weights.shape[0]
        if rows <= capacity:
            return
        new_capacity = min(max(rows, 2 * capacity), self.share)
        assert new_capacity >= rows, "reserve past the shard's share"
        for name in ("ids", "weights", "state", "last_access"):
            old = getattr(self, name)
            new = memory.empty((new_capacity, *old.shape[1:]), old.dtype)
            new[: self.size] = old[: self.size]
            setattr(self, name, new)
        self.index.row_ids = self.ids

    def _log_changes(self, ids: np.ndarray) -> None:
        """Remember ``ids`` as changed (ids no longer stored are dropped on export)."""
        if self.changed is None:
            return
        self.changed.append(ids.copy())
        self.num_changed += ids.shape[0]
        if self.num_changed > 4 * max(self.size, _INITIAL_ROWS):  # bound the log's memory
            merged = np.unique(np.concatenate(self.changed))
            self.changed, self.num_changed = [merged], merged.shape[0]

    def _log_removed(self, ids: np.ndarray) -> None:
        self.removed.append(ids.copy())
        self.num_removed += ids.shape[0]
        if self.num_removed > 4 * max(self.share // _EVICT_FRACTION, _INITIAL_ROWS):
            # Bound the log: repeats go, and so do ids stored again since.
            merged = np.unique(np.concatenate(self.removed))
            merged = merged[self.index.find(merged) < 0]
            self.removed, self.num_removed = [merged], merged.shape[0]

    def take_changes(self) -> tuple[np.ndarray, ...]:
        """Copies of the rows changed since the last call (ids, weights, state, last
        access) of those still stored, and the ids removed since (evicted or expired) and
        not stored again: disjoint from the rows' ids. The logs start again empty."""
        with self.lock:
            ids = (np.unique(np.concatenate(self.changed)) if self.changed
                   else np.zeros(0, np.uint64))
            removed = (np.unique(np.concatenate(self.removed)) if self.removed
                       else np.zeros(0, np.uint64))
            self.changed, self.num_changed = [], 0
            self.removed, self.num_removed = [], 0
            rows = self.index.find(ids)
            rows = rows[rows >= 0]
            removed = removed[self.index.find(removed) < 0]
            return (self.ids[rows], self.weights[rows], self.state[rows],
                    self.clock.absolute(self.last_access[rows]), removed)

    def remove_ids(self, ids: np.ndarray) -> int:
        """Delete the rows of ``ids`` (distinct) that are stored; returns how many."""
        with self.lock:
            rows = self.index.find(ids)
            rows = rows[rows >= 0]
            if rows.shape[0]:
                self._remove(rows)
            return int(rows.shape[0])

    def update(self, ids: np.ndarray, grads: np.ndarray, tick: int) -> int:
        with self.lock:
            self._log_changes(ids)
            rows, grads, merged = kernels.sum_duplicate_rows(self.index.find(ids), grads,
                                                             self.size)
            if merged and self.table.row_dtype != "float32":
                ids = self.ids[rows]  # the ids of the distinct rows, which key rounding
            stamp = self.clock.stamp(tick, self.last_access[:self.size])
            return self.table._step(self.weights, self.state, rows, grads,
                                    self.last_access, stamp, ids)


def _check_array(name: str, value: object, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
    if (not isinstance(value, np.ndarray) or value.dtype != dtype or value.shape != shape):
        got = (f"{value.dtype} {value.shape}" if isinstance(value, np.ndarray)
               else type(value).__name__)
        raise ValueError(f"{name} must be {np.dtype(dtype).name} of shape {shape}, got {got}")
    return value


def _check_fits(shard: _Shard, ids: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Rows of ``ids`` in ``shard`` (-1: absent) and how many are absent; ValueError if
    storing them would exceed the shard's share. The caller holds ``shard.lock``."""
    rows = shard.index.find(ids)
    n_new = int(np.count_nonzero(rows < 0))
    if shard.size + n_new > shard.share:
        raise ValueError(f"{shard.size + n_new} rows do not fit one internal shard's share "
                         f"of {shard.share} (capacity {capacity}); raise capacity")
    return rows, n_new


def _check_int(name: str, value: object, minimum: int) -> int:
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if not ok or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class EmbeddingTable:
    """Embedding rows of one slot with lazy insertion, row-wise optimizer and LRU cap.

    Policies (each off by default):

    * ``admit_probability`` (0, 1]: a new id is stored on a training lookup with this
      probability; the draw is a hash of ``(id, seed, step)``, so a rerun with the same
      calls makes the same choices, and an id refused now may be admitted when it comes
      again (frequent ids get in sooner, as in PERSIA).
    * ``min_occurrences`` >= 1: a new id is stored only from the training lookup in which
      it is seen for the ``min_occurrences``-th time (counted per lookup call in a
      count-min sketch of 4 x up to 4M one-byte counters per shard, halved every 8
      sightings per counter column; collisions can only make an id count higher).
    * An id not stored reads as zeros and its gradients are dropped, as PERSIA did.
    * ``row_dtype``: weights stored as ``float32``, ``float16`` or ``bfloat16``
      (:mod:`persia_py.servers.row_types`); steps compute in float32 and round back
      stochastically (``stochastic_rounding=False``: to nearest, only to measure what
      stochastic rounding buys). Optimizer state is float32 whatever the type.
    * ``expire_after_steps`` / ``expire_after_seconds``: rows neither looked up nor
      updated during the last that many lookup calls (steps) / seconds are removed; a
      sweep runs at the start of a lookup once 1/16 of the period has passed since the
      last sweep, so a row may outlive its period by up to 1/16 of it.
    """

    def __init__(self, *, dim: int, optimizer: OptimizerConfig, init_lower: float = -0.01,
                 init_upper: float = 0.01, seed: int = 0, num_shards: int = 1,
                 capacity: int = 1_000_000, weight_bound: float | None = None,
                 admit_probability: float = 1.0, min_occurrences: int = 1,
                 expire_after_steps: int | None = None,
                 expire_after_seconds: float | None = None, row_dtype: str = "float32",
                 stochastic_rounding: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # The same rules as the config file and the user's EmbeddingConfig.
        TablePolicy(capacity=capacity, admit_probability=admit_probability,
                    min_occurrences=min_occurrences, expire_after_steps=expire_after_steps,
                    expire_after_seconds=expire_after_seconds)
        self.dim = _check_int("dim", dim, 1)
        self.num_shards = _check_int("num_shards", num_shards, 1)
        self.capacity = int(capacity)
        self.seed = _check_int("seed", seed, 0)
        self.state_width = state_width(optimizer, dim)  # rejects non-config objects
        self.optimizer = optimizer
        self.init_lower, self.init_upper = check_init_bounds(init_lower, init_upper,
                                                             "init_lower, init_upper")
        self.weight_bound = check_weight_bound(weight_bound)
        self.admit_probability = float(admit_probability)
        self.min_occurrences = int(min_occurrences)
        self.expire_after_steps = (None if expire_after_steps is None
                                   else int(expire_after_steps))
        self.expire_after_seconds = (None if expire_after_seconds is None
                                     else float(expire_after_seconds))
        self._step_args = _step_args(optimizer, self.weight_bound)
        self.row_dtype = row_types.check_row_dtype(row_dtype)
        if type(stochastic_rounding) is not bool:
            raise ValueError(f"stochastic_rounding: expected True or False, got "
                             f"{stochastic_rounding!r}")
        self._rounding = (mix64(np.uint64(self.seed), ROUNDING_SALT), stochastic_rounding)
        share = -(-capacity // num_shards)
        self._shards = [_Shard(self, share) for _ in range(num_shards)]
        self._shard_key = HashKey.random()
        self._clock = 0
        self._clock_lock = threading.Lock()
        self._now = clock
        self._tick_times: collections.deque[tuple[float, int]] = collections.deque()
        self._seconds_cutoff = 0
        self._last_sweep_tick = 0
        self._last_sweep_time = clock()
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

    def __enter__(self) -> EmbeddingTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _tick(self) -> tuple[int, int]:
        """Advance the clock (one step per lookup); returns ``(tick, expiry cutoff)``.

        The cutoff is 0 unless an expiry sweep is due now; then rows last touched
        before it are to be removed.
        """
        with self._clock_lock:
            self._clock += 1
            tick = self._clock
            cutoff = 0
            due = False
            if self.expire_after_steps is not None:
                cutoff = tick - self.expire_after_steps
                due = tick - self._last_sweep_tick >= max(
                    1, self.expire_after_steps // _EXPIRE_LAG)
            if self.expire_after_seconds is not None:
                now = self._now()
                self._tick_times.append((now, tick))
                horizon = now - self.expire_after_seconds
                while self._tick_times and self._tick_times[0][0] <= horizon:
                    self._seconds_cutoff = self._tick_times.popleft()[1] + 1
                cutoff = max(cutoff, self._seconds_cutoff)
                due = due or now - self._last_sweep_time >= (
                    self.expire_after_seconds / _EXPIRE_LAG)
            if not due or cutoff <= 0:
                return tick, 0
            self._last_sweep_tick = tick
            if self.expire_after_seconds is not None:
                self._last_sweep_time = self._now()
            return tick, cutoff

    def _current_tick(self) -> int:
        with self._clock_lock:
            return self._clock

    def _check_ids(self, ids: np.ndarray) -> np.ndarray:
        if not isinstance(ids, np.ndarray) or ids.dtype != np.uint64 or ids.ndim != 1:
            got = (f"dtype {ids.dtype}, shape {ids.shape}" if isinstance(ids, np.ndarray)
                   else type(ids).__name__)
            raise ValueError(f"ids must be a 1-D numpy array of dtype uint64, got {got}")
        if bool((ids == RESERVED_ID).any()):
            raise ValueError("ids contain the reserved id 2**64-1, which cannot be stored")
        return np.ascontiguousarray(ids)

    def _split_by_shard(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``split_by`` of ids by internal shard.

        The shard of an id is a keyed hash, secret to this table: with a public one,
        ids could be crafted to fill one shard's share of the capacity (evicting its
        honest rows, or failing batches) and to serialize every call on its lock. Shard
        placement is local to the process: a checkpoint load re-inserts rows.
        """
        num_shards = self.num_shards
        return split_by(keyed_buckets(ids, self._shard_key, num_shards), num_shards)

    def _per_shard(self, ids: np.ndarray,
                   work: Callable[[_Shard, np.ndarray | None], None]) -> None:
        """Call ``work(shard, positions)`` for each shard owning some of ``ids``.

        ``positions`` is None when one shard owns every id. A failure in one shard does
        not undo the others' work; the first error is re-raised once every shard has
        finished.
        """
        if self.num_shards == 1:
            work(self._shards[0], None)
            return
        order, bounds = self._split_by_shard(ids)
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

    def lookup(self, ids: np.ndarray, insert: bool, *, out: np.ndarray | None = None,
               dtype: npt.DTypeLike = np.float32) -> np.ndarray:
        """Rows for ``ids`` as ``dtype`` ``(len(ids), dim)``; repeats are allowed.

        With ``insert`` missing ids are created (deterministic initial values, fresh
        optimizer state) if the admission policy lets them in, evicting
        least-recently-used rows if the shard is full; ids not stored read as zero
        rows. Raises ValueError if one internal shard cannot fit the batch's new ids
        even after evicting every row the batch does not touch. ``dtype``: float32, or
        float16 for a float16 table (its rows as stored: no conversion). ``out``: a
        C-contiguous array of that shape and dtype to write the rows to (returned).
        """
        ids = self._check_ids(ids)
        shape = (ids.shape[0], self.dim)
        dtype = np.dtype(dtype)
        if dtype != np.float32 and not (dtype == np.float16 and self.row_dtype == "float16"):
            raise ValueError(f"dtype: a {self.row_dtype} table answers float32 rows"
                             f"{' or float16 ones' if self.row_dtype == 'float16' else ''}, "
                             f"not {dtype}")
        if out is None:
            out = np.empty(shape, dtype=dtype)
        elif (not isinstance(out, np.ndarray) or out.dtype != dtype
              or out.shape != shape or not out.flags.c_contiguous):
            raise ValueError(f"out must be a C-contiguous {dtype} array of shape {shape}")
        tick, cutoff = self._tick()
        if cutoff > 0:
            for shard in self._shards:
                shard.expire(cutoff)
        insert = bool(insert)

        def work(shard: _Shard, positions: np.ndarray | None) -> None:
            part = ids if positions is None else ids[positions]
            shard.lookup(part, insert, tick, out, positions)

        self._per_shard(ids, work)
        return out

    def update(self, ids: np.ndarray, grads: np.ndarray) -> int:
        """Apply one optimizer step; returns how many distinct rows were updated.

        Gradients of repeated ids are summed first. Ids not in the table (never
        looked up with insert, not admitted, or evicted or expired since) are skipped.
        Bad input raises ValueError and changes nothing (:meth:`check_update`).
        """
        return self.apply_update(*self.check_update(ids, grads))

    def check_update(self, ids: np.ndarray, grads: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, grads)`` as :meth:`apply_update` takes them (contiguous uint64 ids,
        float32 gradients), or ValueError saying what is wrong: ids, shape, dtype, NaN."""
        ids = self._check_ids(ids)
        if not isinstance(grads, np.ndarray) or grads.shape != (ids.shape[0], self.dim):
            got = grads.shape if isinstance(grads, np.ndarray) else type(grads).__name__
            raise ValueError(f"grads of shape {got} do not match {ids.shape[0]} ids of dim "
                             f"{self.dim}: expected ({ids.shape[0]}, {self.dim})")
        if grads.dtype.kind != "f":
            raise ValueError(f"grads must have a floating dtype, got {grads.dtype}")
        grads = (cast_float(grads, "float32") if grads.dtype == np.float16
                 else np.ascontiguousarray(grads, dtype=np.float32))
        if not bool(np.isfinite(grads).all()):
            raise ValueError("grads contain NaN or infinite values; nothing was updated")
        return ids, grads

    def apply_update(self, ids: np.ndarray, grads: np.ndarray) -> int:
        """:meth:`update` of input :meth:`check_update` returned (not checked again)."""
        if ids.shape[0] == 0:
            return 0
        tick = self._current_tick()
        counts: list[int] = []

        def work(shard: _Shard, positions: np.ndarray | None) -> None:
            if positions is None:
                counts.append(shard.update(ids, grads, tick))
            else:
                counts.append(shard.update(ids[positions], grads[positions], tick))

        self._per_shard(ids, work)
        return sum(counts)

    def _step(self, weights: np.ndarray, state: np.ndarray, rows: np.ndarray,
              grads: np.ndarray, stamps: np.ndarray, tick: int, ids: np.ndarray) -> int:
        """One optimizer step on ``rows`` (distinct; < 0 skipped) of one shard, in place;
        ``ids[i]``: the id of ``rows[i]`` (ids key stochastic rounding; read in order, where
        the shard's ids by row would cost a cache miss per row)."""
        kind, params = self._step_args
        weights = kernel_view(weights)
        if kind == _SGD:
            return kernels.sgd_step(weights, rows, grads, stamps, tick, ids, *self._rounding,
                                    *params)
        return kernels.adaptive_step(kind, weights, state, rows, grads, stamps, tick, ids,
                                     *self._rounding, *params)

    def export_rows(self) -> dict[str, np.ndarray | int | str]:
        """Copies of every stored row, for checkpoints: ``ids`` (uint64 [n]), ``weights``
        ([n, dim] as stored: ``row_dtype``'s numpy type), ``state`` (float32 [n,
        state_width]), ``last_access`` (int64 [n], the LRU clock), ``clock`` (int) and
        ``row_dtype`` (str). Each shard is copied under its lock."""
        parts = []
        for shard in self._shards:
            with shard.lock:
                n = shard.size
                parts.append((shard.ids[:n].copy(), shard.weights[:n].copy(),
                              shard.state[:n].copy(),
                              shard.clock.absolute(shard.last_access[:n])))
        ids, weights, state, stamps = (np.concatenate(p) for p in zip(*parts))
        with self._clock_lock:
            clock = self._clock
        return {"ids": ids, "weights": weights, "state": state, "last_access": stamps,
                "clock": clock, "row_dtype": self.row_dtype}

    def track_changes(self) -> None:
        """From now on, remember which rows are inserted or updated (for incremental
        exports: :meth:`export_changed_rows`)."""
        for shard in self._shards:
            with shard.lock:
                if shard.changed is None:
                    shard.changed = []

    def export_changed_rows(self) -> tuple[dict[str, np.ndarray | int | str], np.ndarray]:
        """Like :meth:`export_rows`, but only the rows inserted or updated since the last
        call (still stored ones), and the ids removed since (evicted or expired, not
        stored again; uint64, distinct from the rows' ids); each shard's logs are taken
        and emptied under its lock."""
        parts = [shard.take_changes() for shard in self._shards]
        ids, weights, state, stamps, removed = (np.concatenate(p) for p in zip(*parts))
        with self._clock_lock:
            clock = self._clock
        return ({"ids": ids, "weights": weights, "state": state, "last_access": stamps,
                 "clock": clock, "row_dtype": self.row_dtype}, removed)

    def remove_ids(self, ids: np.ndarray) -> int:
        """Delete the stored rows of ``ids`` (e.g. ids an increment says the training side
        evicted or expired); absent ids are skipped. Returns how many rows went."""
        ids = np.unique(self._check_ids(ids))
        if ids.shape[0] == 0:
            return 0
        counts: list[int] = []

        def work(shard: _Shard, positions: np.ndarray | None) -> None:
            counts.append(shard.remove_ids(ids if positions is None else ids[positions]))

        self._per_shard(ids, work)
        return sum(counts)

    def import_rows(self, ids: np.ndarray, weights: np.ndarray, state: np.ndarray,
                    last_access: np.ndarray | None = None, clock: int = 0,
                    row_dtype: str = "float32") -> None:
        """Store rows as given, e.g. from a checkpoint; stored rows of the same ids are
        overwritten. Weights of another ``row_dtype`` than the table's are converted
        (to nearest; exact when widening).

        All or nothing: checked first, ValueError says what is wrong and nothing is
        stored: ids (1-D uint64, distinct, not the reserved id), ``weights`` of
        ``row_dtype`` ``(n, dim)`` (within float16's range if the table is float16) and
        ``state`` float32 ``(n, state width)``, both finite,
        ``last_access`` int64 ``(n,)`` in ``[0, clock]``, ``clock`` an int in
        ``[0, MAX_CLOCK]``, and every internal shard within its share of the capacity.
        """
        ids = self._check_ids(ids)
        n = ids.shape[0]
        row_dtype = row_types.check_row_dtype(row_dtype)
        _check_array("weights", weights, row_types.numpy_dtype(row_dtype), (n, self.dim))
        _check_array("state", state, np.float32, (n, self.state_width))
        clock = _check_int("clock", clock, 0)
        if clock > MAX_CLOCK:
            raise ValueError(f"clock must be <= {MAX_CLOCK}, got {clock}")
        if last_access is None:
            stamps = np.zeros(n, np.int64)
        else:
            stamps = _check_array("last_access", last_access, np.int64, (n,))
            if n and not (int(stamps.min()) >= 0 and int(stamps.max()) <= clock):
                raise ValueError(f"last_access must lie in [0, clock={clock}], got "
                                 f"[{int(stamps.min())}, {int(stamps.max())}]")
        if not row_types.all_finite(weights, row_dtype):
            raise ValueError("weights contain NaN or infinite values")
        if not bool(np.isfinite(state).all()):
            raise ValueError("state contain NaN or infinite values")
        weights = row_types.convert(weights, row_dtype, self.row_dtype)
        ordered = np.sort(ids)  # repeats are neighbours once sorted (cheaper than np.unique)
        repeats = int(np.count_nonzero(ordered[1:] == ordered[:-1]))
        if repeats:
            raise ValueError(f"ids are not distinct ({repeats} repeats)")
        order, bounds = self._split_by_shard(ids)
        parts = [(shard, order[bounds[k]:bounds[k + 1]]) for k, shard in enumerate(self._shards)]
        for shard, pos in parts:  # capacity, for every shard before any row is stored
            with shard.lock:
                _check_fits(shard, ids[pos], self.capacity)
        clock = max(clock, self._current_tick())
        for shard, pos in parts:
            with shard.lock:
                # Checked again under the lock that the store holds: a concurrent insert
                # (training lookups of a live table) may have taken room meanwhile.
                rows, n_new = _check_fits(shard, ids[pos], self.capacity)
                new = rows < 0
                shard._reserve(shard.size + n_new)
                new_rows, _ = shard.index.find_or_insert(ids[pos][new], shard.size)
                rows[new] = new_rows
                shard.size += n_new
                shard.ids[rows] = ids[pos]
                kernels.scatter_rows(kernel_view(shard.weights), rows, kernel_view(weights),
                                     pos)
                kernels.scatter_rows(shard.state, rows, state, pos)
                shard.last_access[rows] = shard.clock.relative(
                    stamps[pos], clock, shard.last_access[:shard.size])
        with self._clock_lock:
            self._clock = max(self._clock, clock)

    @property
    def num_entries(self) -> int:
        """Rows currently stored, over all internal shards."""
        return sum(shard.size for shard in self._shards)

    def stats(self) -> dict[str, int]:
        """Counters over all shards.

        ``hits``/``misses`` count looked-up ids (repeats included) found/not found;
        ``admitted``/``rejected`` count distinct absent ids of training lookups that the
        admission policy let in / kept out (per call); ``inserted``/``evicted``/
        ``expired`` count rows; ``bytes`` is the resident array size.
        """
        totals = dict.fromkeys(STAT_KEYS, 0)
        for shard in self._shards:
            with shard.lock:
                totals["entries"] += shard.size
                totals["bytes"] += shard.nbytes()
                for key in STAT_KEYS[2:]:
                    totals[key] += getattr(shard, key)
        return totals


_DTYPES = {"ids": np.uint64, "weights": np.float32, "state": np.float32,
           "last_access": STAMP_DTYPE}
"""Element types of a shard's row arrays."""


def row_dtypes() -> dict[str, np.dtype]:
    """Element types of a shard's row arrays, by array name (for sizing)."""
    return {name: np.dtype(dtype) for name, dtype in _DTYPES.items()}

STAT_KEYS = ("entries", "bytes", "hits", "misses", "inserted", "evicted", "admitted",
             "rejected", "expired")
"""Keys of :meth:`EmbeddingTable.stats`, in the order of the ``TableStats`` message."""


_SGD = 0
"""``_step_args``'s kind for SGD (:func:`kernels.sgd_step`); Adagrad and Adam use
:func:`kernels.adaptive_step`'s kinds."""


def _step_args(cfg: OptimizerConfig, weight_bound: float | None) -> tuple[int, tuple]:
    """The step kernel's kind and its hyper-parameters (those after ``tick``), converted
    once per table."""
    f32 = np.float32
    lr, weight_decay = f32(cfg.lr), f32(cfg.weight_decay)
    bound = f32(np.inf if weight_bound is None else weight_bound)
    if isinstance(cfg, SGDConfig):
        return _SGD, (lr, weight_decay, bound)
    if isinstance(cfg, AdagradConfig):
        return kernels.ADAGRAD, (lr, weight_decay, bound, f32(cfg.eps),
                                 f32(cfg.g_square_momentum), 0.0, 0.0)
    if isinstance(cfg, AdamConfig):
        return kernels.ADAM, (lr, weight_decay, bound, f32(cfg.eps), f32(0.0),
                              float(cfg.betas[0]), float(cfg.betas[1]))
    raise ValueError(f"unsupported optimizer {type(cfg).__name__}")

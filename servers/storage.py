"""``EmbeddingTable``: the rows of one embedding slot on one parameter-server replica.

The table is split into internal shards (:mod:`persia_py.servers.shard`, chosen by a
keyed hash), each with its own hash index, lock and contiguous row arrays; lookups and
optimizer steps are fused numba kernels that read and write each id's row in place.

Per-table policies, all optional: admission of new ids
(:mod:`persia_py.servers.admission`), expiry of rows unseen for a number of steps or
seconds (:mod:`persia_py.servers.lookup_clock`), and a capacity past which the least
recently used rows are evicted. Rows travel to and from checkpoints and increments
through :meth:`EmbeddingTable.export_rows` and :meth:`EmbeddingTable.import_rows`
(:mod:`persia_py.servers.row_transfer`).

Batches are split by shard and, when there are several shards and the batch is big
enough, the shards are worked on in parallel threads: every kernel releases the GIL.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import numpy.typing as npt

from persia_py.config import DiskTierConfig
from persia_py.config.table_policy import TablePolicy, check_init_bounds, check_weight_bound
from persia_py.ids.hashing import HashKey, keyed_buckets
from persia_py.ids.routing import RESERVED_ID, split_by
from persia_py.servers import row_types
from persia_py.servers.disk_tier import DiskTier
from persia_py.servers.lookup_clock import LookupClock
from persia_py.servers.optimizers import OptimizerConfig, state_width
from persia_py.servers.row_step import RowStep
from persia_py.servers.row_stream import RowChunks, RowSink, load_table, stream_table
from persia_py.servers.row_transfer import check_import, check_int, exported_rows
from persia_py.servers.shard import Shard
from persia_py.servers.shard_arrays import row_dtypes
from persia_py.wire.finite import all_finite

__all__ = ["STAT_KEYS", "EmbeddingTable", "row_dtypes"]

# Below this many ids, handing shards to worker threads costs more than it saves.
_PARALLEL_MIN_IDS = 8192

STAT_KEYS = ("entries", "bytes", "hits", "misses", "inserted", "evicted", "admitted",
             "rejected", "expired")
"""Keys of :meth:`EmbeddingTable.stats`, in the order of the ``TableStats`` message."""


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
      last sweep, so a row may outlive its period by up to 1/16 of it. With a disk tier
      the row goes from disk too, unless ``disk_tier.spill_expired`` (then a row
      expiring in RAM moves to disk); the tier's own ``expire_after_steps`` /
      ``expire_after_seconds`` delete rows on disk unused that long.
    * ``disk_tier``: rows evicted at capacity spill to a disk tier per internal shard
      (:mod:`persia_py.servers.disk_tier`; ``capacity_rows`` split among the shards) and
      come back into RAM when looked up or updated; :meth:`disk_stats`. Checkpoints
      (:meth:`export_rows`, :meth:`import_rows`) and increments hold disk rows too.
      :meth:`close` deletes the tier's rows: the table is then no longer usable.
    """

    def __init__(self, *, dim: int, optimizer: OptimizerConfig, init_lower: float = -0.01,
                 init_upper: float = 0.01, seed: int = 0, num_shards: int = 1,
                 capacity: int = 1_000_000, weight_bound: float | None = None,
                 admit_probability: float = 1.0, min_occurrences: int = 1,
                 expire_after_steps: int | None = None,
                 expire_after_seconds: float | None = None, row_dtype: str = "float32",
                 stochastic_rounding: bool = True,
                 disk_tier: DiskTierConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # The same rules as the config file and the user's EmbeddingConfig.
        TablePolicy(capacity=capacity, admit_probability=admit_probability,
                    min_occurrences=min_occurrences, expire_after_steps=expire_after_steps,
                    expire_after_seconds=expire_after_seconds)
        self.dim = check_int("dim", dim, 1)
        self.num_shards = check_int("num_shards", num_shards, 1)
        self.capacity = int(capacity)
        self.seed = check_int("seed", seed, 0)
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
        self.row_dtype = row_types.check_row_dtype(row_dtype)
        self.row_type = row_types.row_type(self.row_dtype)
        """What the storage type ``row_dtype`` is (:data:`row_types.ROW_TYPES`)."""
        if type(stochastic_rounding) is not bool:
            raise ValueError(f"stochastic_rounding: expected True or False, got "
                             f"{stochastic_rounding!r}")
        self.row_step = RowStep(optimizer, weight_bound=self.weight_bound, seed=self.seed,
                                stochastic_rounding=stochastic_rounding)
        """The optimizer step the shards run on their rows."""
        share = -(-capacity // num_shards)
        if disk_tier is not None and not isinstance(disk_tier, DiskTierConfig):
            raise ValueError(f"disk_tier: expected a DiskTierConfig or None, got {disk_tier!r}")
        self.disk_tier = disk_tier if disk_tier is not None and disk_tier.enabled else None
        self._shards: list[Shard] = []
        try:
            for _ in range(num_shards):
                self._shards.append(Shard(self, share, self._new_tier()))
        except BaseException:
            self._close_tiers()
            raise
        self._shard_key = HashKey.random()
        tier = self.disk_tier
        self._clock = LookupClock(
            expire_after_steps=self.expire_after_steps,
            expire_after_seconds=self.expire_after_seconds, now=clock,
            disk_expire_after_steps=None if tier is None else tier.expire_after_steps,
            disk_expire_after_seconds=None if tier is None else tier.expire_after_seconds)
        self._executor: ThreadPoolExecutor | None = None
        if num_shards > 1:
            self._executor = ThreadPoolExecutor(
                max_workers=min(num_shards, os.cpu_count() or 1),
                thread_name_prefix="embedding-shard")

    def _new_tier(self) -> DiskTier | None:
        config = self.disk_tier
        if config is None:
            return None
        return DiskTier(str(config.path),
                        capacity_rows=-(-config.capacity_rows // self.num_shards),
                        dim=self.dim, weight_dtype=row_types.numpy_dtype(self.row_dtype),
                        state_width=self.state_width, free_fraction=config.free_fraction,
                        stamped=self._disk_rows_expire())

    def _disk_rows_expire(self) -> bool:
        """Whether a TTL deletes rows on disk: the tier's own, or the slot's (unless
        ``spill_expired``)."""
        config = self.disk_tier
        if config is None:
            return False
        slot = (self.expire_after_steps is not None or self.expire_after_seconds is not None)
        return (config.expire_after_steps is not None
                or config.expire_after_seconds is not None
                or (slot and not config.spill_expired))

    def _expire(self, cutoff: int, disk_cutoff: int) -> None:
        """Expiry sweeps due now (:class:`LookupClock`): the slot's TTL over RAM (and the
        disk, unless ``spill_expired``), the disk's own over the disk."""
        spill = self.disk_tier is not None and self.disk_tier.spill_expired
        on_disk = max(disk_cutoff, 0 if spill else cutoff)
        for shard in self._shards:
            shard.expire(cutoff, on_disk, spill=spill)

    def _close_tiers(self) -> None:
        for shard in self._shards:
            if shard.tier is not None:
                with shard.lock:
                    shard.tier.close()

    def close(self) -> None:
        """Stop the shard worker threads; the table stays usable, serially. With a disk
        tier, its files are closed and their rows gone: the table is no longer usable."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self._close_tiers()

    def __enter__(self) -> EmbeddingTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
                   work: Callable[[Shard, np.ndarray | None], None]) -> None:
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
        float16 for a float16 table (its rows as stored: no conversion) or a float32 one
        (rounded to nearest as they are copied, as numpy's cast does). ``out``: a
        C-contiguous array of that shape and dtype to write the rows to (returned).
        """
        ids, out, tick = self.start_lookup(ids, out, dtype)
        self.lookup_started(ids, bool(insert), tick, out)
        return out

    def start_lookup(self, ids: np.ndarray, out: np.ndarray | None, dtype: npt.DTypeLike
                     ) -> tuple[np.ndarray, np.ndarray, int]:
        """:meth:`lookup`'s checks, its ``out`` and its tick (after the expiry sweeps due):
        what :meth:`lookup_started`, or a call over many tables
        (:mod:`persia_py.servers.request_tables`), goes on with."""
        ids = self._check_ids(ids)
        shape = (ids.shape[0], self.dim)
        dtype = np.dtype(dtype)
        half = self.row_type.answers_float16
        if dtype != np.float32 and not (dtype == np.float16 and half):
            raise ValueError(f"dtype: a {self.row_dtype} table answers float32 rows"
                             f"{' or float16 ones' if half else ''}, not {dtype}")
        if out is None:
            out = np.empty(shape, dtype=dtype)
        elif (not isinstance(out, np.ndarray) or out.dtype != dtype
              or out.shape != shape or not out.flags.c_contiguous):
            raise ValueError(f"out must be a C-contiguous {dtype} array of shape {shape}")
        tick, cutoff, disk_cutoff = self._clock.tick()
        if cutoff > 0 or disk_cutoff > 0:
            self._expire(cutoff, disk_cutoff)
        return ids, out, tick

    def lookup_started(self, ids: np.ndarray, insert: bool, tick: int, out: np.ndarray) -> None:
        """The rest of :meth:`lookup`, shard by shard, after :meth:`start_lookup`."""

        def work(shard: Shard, positions: np.ndarray | None) -> None:
            part = ids if positions is None else ids[positions]
            shard.lookup(part, insert, tick, out, positions)

        self._per_shard(ids, work)

    def single_shard(self) -> Shard | None:
        """The table's only internal shard, when a call over many tables may serve it in
        one kernel call with the others (:mod:`persia_py.servers.request_tables`): one
        internal shard and no disk tier (else None)."""
        return self._shards[0] if self.num_shards == 1 and self.disk_tier is None else None

    @property
    def clock_now(self) -> int:
        """The table's clock now (the tick of an update)."""
        return self._clock.current()

    def prefetch(self, ids: np.ndarray) -> int:
        """Bring the rows of ``ids`` that are on the disk tier back into RAM, as a lookup
        would (a hint that they will be looked up soon: :mod:`persia_py.servers.prefetch`);
        ids stored nowhere are not created. Returns how many rows came back."""
        ids = self._check_ids(ids)
        if self.disk_tier is None:
            return 0
        tick = self._clock.current()
        moved: list[int] = []

        def work(shard: Shard, positions: np.ndarray | None) -> None:
            moved.append(shard.prefetch(ids if positions is None else ids[positions], tick))

        self._per_shard(ids, work)
        return sum(moved)

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
        contiguous float32 or float16 gradients: the kernels widen float16 as they read
        it, so a float16 wire's gradients are not copied), or ValueError saying what is
        wrong: ids, shape, dtype, NaN."""
        ids = self._check_ids(ids)
        if not isinstance(grads, np.ndarray) or grads.shape != (ids.shape[0], self.dim):
            got = grads.shape if isinstance(grads, np.ndarray) else type(grads).__name__
            raise ValueError(f"grads of shape {got} do not match {ids.shape[0]} ids of dim "
                             f"{self.dim}: expected ({ids.shape[0]}, {self.dim})")
        if grads.dtype.kind != "f":
            raise ValueError(f"grads must have a floating dtype, got {grads.dtype}")
        grads = np.ascontiguousarray(grads, dtype=np.float16 if grads.dtype == np.float16
                                     else np.float32)
        if not all_finite(grads):
            raise ValueError("grads contain NaN or infinite values; nothing was updated")
        return ids, grads

    def apply_update(self, ids: np.ndarray, grads: np.ndarray) -> int:
        """:meth:`update` of input :meth:`check_update` returned (not checked again)."""
        if ids.shape[0] == 0:
            return 0
        tick = self.clock_now
        counts: list[int] = []

        def work(shard: Shard, positions: np.ndarray | None) -> None:
            if positions is None:
                counts.append(shard.update(ids, grads, tick))
            else:
                # np.take copies whole rows; grads[positions] goes element by element, slower
                counts.append(shard.update(ids[positions], np.take(grads, positions, axis=0),
                                           tick))

        self._per_shard(ids, work)
        return sum(counts)

    def export_rows(self) -> dict[str, np.ndarray | int | str]:
        """Copies of every stored row, for checkpoints: ``ids`` (uint64 [n]), ``weights``
        ([n, dim] as stored: ``row_dtype``'s numpy type), ``state`` (float32 [n,
        state_width]), ``last_access`` (int64 [n], the LRU clock), ``clock`` (int) and
        ``row_dtype`` (str). Each shard is copied under its lock."""
        parts = [shard.copy_rows() for shard in self._shards]
        return exported_rows(parts, self._clock.current(), self.row_dtype)

    def track_changes(self) -> None:
        """From now on, remember which rows are inserted or updated (for incremental
        exports: :meth:`export_changed_rows`)."""
        for shard in self._shards:
            with shard.lock:
                shard.changes.start()

    def export_changed_rows(self) -> tuple[dict[str, np.ndarray | int | str], np.ndarray]:
        """Like :meth:`export_rows`, but only the rows inserted or updated since the last
        call (still stored ones), and the ids removed since (evicted or expired, not
        stored again; uint64, distinct from the rows' ids); each shard's logs are taken
        and emptied under its lock."""
        changes = [shard.take_changes() for shard in self._shards]
        removed = np.concatenate([change[4] for change in changes])
        return (exported_rows([change[:4] for change in changes], self._clock.current(),
                              self.row_dtype), removed)

    def remove_ids(self, ids: np.ndarray) -> int:
        """Delete the stored rows of ``ids`` (e.g. ids an increment says the training side
        evicted or expired); absent ids are skipped. Returns how many rows went."""
        ids = np.unique(self._check_ids(ids))
        if ids.shape[0] == 0:
            return 0
        counts: list[int] = []

        def work(shard: Shard, positions: np.ndarray | None) -> None:
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
        ``[0, MAX_CLOCK]`` (:data:`persia_py.servers.row_transfer.MAX_CLOCK`), and every
        internal shard within its share of the capacity.
        """
        ids = self._check_ids(ids)
        weights, stamps, clock = check_import(
            ids, weights, state, last_access, clock, row_dtype, dim=self.dim,
            state_width=self.state_width, table_dtype=self.row_dtype)
        order, bounds = self._split_by_shard(ids)
        parts = [(shard, order[bounds[k]:bounds[k + 1]]) for k, shard in enumerate(self._shards)]
        for shard, pos in parts:  # capacity, for every shard before any row is stored
            with shard.lock:
                shard.check_fits(ids[pos])
        clock = max(clock, self._clock.current())
        for shard, pos in parts:
            shard.store_rows(ids, pos, weights, state, stamps, clock)
        self._clock.advance_to(clock)

    def stream_rows(self, sink: RowSink) -> tuple[int, int]:
        """Hand every stored row (RAM and disk) to ``sink`` in slices, as
        :meth:`export_rows` would copy them, without copying: each shard under its lock
        (:func:`persia_py.servers.row_stream.stream_table`); returns (how many, the
        table's clock after)."""
        return stream_table(self, sink), self._clock.current()

    def load_chunks(self, rows: RowChunks, name: str = "") -> int:
        """Store ``rows`` (ids and stamps whole, weights and state chunk by chunk) into this
        table, which must hold none yet; returns how many. Checks as :meth:`import_rows`,
        but not all or nothing: after a ValueError drop the table
        (:func:`persia_py.servers.row_stream.load_table`)."""
        return load_table(self, rows, name)

    @property
    def num_entries(self) -> int:
        """Rows currently stored in RAM, over all internal shards (:meth:`disk_stats` for
        the disk tier's)."""
        return sum(shard.size for shard in self._shards)

    def disk_stats(self) -> dict[str, int]:
        """The disk tier's counters and sizes summed over the shards (empty without a
        tier): ``disk_rows`` on disk now, ``disk_capacity_rows``, ``spilled`` /
        ``restored`` rows moved to disk / back to RAM, ``disk_written``, ``disk_read``
        (rows), ``disk_evicted`` (rows deleted at the disk's capacity: also in
        ``stats()['evicted']``), ``disk_deleted`` (on request), ``disk_relocated`` (rows
        moved by compaction), ``disk_hits`` / ``disk_misses`` (ids absent from RAM found /
        not found on disk), ``disk_block_reads``, ``disk_bytes_read``, ``disk_block_bytes``
        (of one block), ``disk_slots``, ``disk_bytes`` (files), ``disk_ram_bytes`` (the
        tiers' index and stamps), ``disk_expired`` (rows a TTL deleted from disk: also in
        ``stats()['expired']``), ``disk_answered`` (looked-up ids, repeats included,
        answered from disk)."""
        totals: dict[str, int] = {}
        for shard in self._shards:
            if shard.tier is None:
                continue
            with shard.lock:
                got = dict(shard.tier.stats(), spilled=shard.spilled, restored=shard.restored,
                           disk_answered=shard.disk_answered)
            for key, value in got.items():
                totals[key] = (value if key in ("disk_block_bytes", "disk_record_bytes")
                               else totals.get(key, 0) + value)
        return totals

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

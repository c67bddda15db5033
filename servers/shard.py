"""``Shard``: the rows of one internal shard of an ``EmbeddingTable``, under one lock.

A shard keeps contiguous row arrays: weights ``(rows, dim)`` (float32, float16 or
bfloat16 bits: :mod:`persia_py.servers.row_types`), optimizer state ``(rows, width)``,
the id of each row, and the row's last access on the table's clock (2 bytes:
:mod:`persia_py.servers.access_clock`), with a hash index from id to row
(:mod:`persia_py.servers.hash_index`). Rows are dense (``0..size-1``): lookups and
optimizer steps are fused numba kernels (:mod:`persia_py.servers.kernels`) that read and
write each id's row in place, and eviction compacts by moving surviving tail rows into
the holes, deleting and repointing only the index entries of the rows it removes and
moves (:mod:`persia_py.servers.hash_removal`). Where the OS allows, the arrays take
the shard's whole share of the capacity as address space at once, so rows never move to
grow.

With a disk tier (:mod:`persia_py.servers.disk_tier`, opt-in), eviction spills the rows
(weights and optimizer state) to it instead of deleting them, the least frequently looked
up first (a count-min sketch of every id's lookups, RAM, disk or new, halved as it ages:
under skewed ids recency alone keeps far less in RAM than a cache of the most frequent
rows would; docs/benchmarks.md, "Disk tier"), and a lookup or
update that meets an id absent from RAM asks the tier for it in one batch and brings the
rows found back into RAM, where they are looked up or updated like any other. A row is in RAM or on
disk, never both; what leaves the disk is deleted: by its capacity (counted as evicted)
or by a TTL (counted as expired: :meth:`Shard.expire`, stamps in
:mod:`persia_py.servers.disk_expiry`).
"""

from __future__ import annotations

import threading

import numpy as np

from persia_py.ids.dedup import unique_in_order
from persia_py.servers import kernels, memory, row_types
from persia_py.servers.access_clock import AccessClock
from persia_py.servers.admission import Admission, frequency_sketch
from persia_py.servers.change_log import ChangeLog, followed_by
from persia_py.servers.disk_tier import DiskTier
from persia_py.servers.hash_index import HashIndex
from persia_py.servers.initializer import initial_rows
from persia_py.servers.optimizers import initial_state
from persia_py.servers.row_hints import RowHints
from persia_py.servers.row_types import kernel_view
from persia_py.servers.shard_arrays import INITIAL_ROWS, ShardOwner, row_arrays

_EVICT_FRACTION = 16
"""Evict at least 1/_EVICT_FRACTION of a shard's share at once, so the O(share) pass
that picks the victims is amortized over many inserts."""

_TOUCHED = 1 << 30
"""Eviction order of the rows a batch touches: above every stamp."""
class Shard:
    """One internal shard; every method that reads or writes rows holds ``lock``."""

    def __init__(self, table: ShardOwner, share: int, tier: DiskTier | None = None) -> None:
        self.table = table
        self.tier = tier
        """Where evicted rows go (None: they are deleted)."""
        self.share = share
        self.lock = threading.Lock()
        arrays, self.reserved = row_arrays(table, share)
        self.ids, self.weights = arrays["ids"], arrays["weights"]
        self.state, self.last_access = arrays["state"], arrays["last_access"]
        self.index = HashIndex(row_ids=self.ids)
        self.clock = AccessClock()
        self.high_water = 0
        """Most rows ever in use: with reserved arrays, the rows whose pages are resident."""
        self.size = 0
        self.hits = self.misses = self.inserted = self.evicted = 0
        self.admitted = self.rejected = self.expired = 0
        self.spilled = self.restored = 0
        """Rows moved to the disk tier / brought back from it."""
        self.disk_answered = 0
        """Looked-up ids (repeats included) answered with rows brought back from disk."""
        self.admission = Admission(share, admit_probability=table.admit_probability,
                                   min_occurrences=table.min_occurrences, seed=table.seed)
        self.frequency = (None if tier is None
                          else frequency_sketch(share))
        """With a disk tier: lookups of every id, in RAM, on disk or new (halved as it
        ages); eviction spills the least frequent rows first, then the least recent."""
        self.changes = ChangeLog()
        """Ids changed and removed since the last ``take_changes`` (increments)."""
        self.hints = RowHints()
        """Rows of recent training lookups, for their updates (request_tables)."""
        self._removed_since_rekey = 0
        """Rows removed since the index was last rebuilt (under a new key)."""
        self._tier_reads = 0
        """Prefetches reading the disk now, without the lock: lookups wait for them."""
        self._tier_read_done = threading.Condition(self.lock)

    def nbytes(self) -> int:
        """Bytes of the rows in use (with reserved arrays: ever used), index, sketch and
        the disk tier's RAM index."""
        arrays = (self.ids, self.weights, self.state, self.last_access)
        rows = self.high_water if self.reserved else self.weights.shape[0]
        row_bytes = sum(a.itemsize * (a.size // max(a.shape[0], 1)) for a in arrays)
        tier = 0 if self.tier is None else self.tier.ram_bytes
        frequency = 0 if self.frequency is None else self.frequency.nbytes
        return (rows * row_bytes + self.index.nbytes + self.admission.nbytes + tier
                + frequency)

    def lookup(self, ids: np.ndarray, insert: bool, tick: int, out: np.ndarray,
               positions: np.ndarray | None) -> None:
        """Write the rows of ``ids`` to ``out`` (at ``positions``, or ``0..n-1``): their bits when
        ``out`` has the weights' type, else converted (:func:`row_types.as_answered`), as it probes."""
        out = kernel_view(out)
        with self.lock:
            while self._tier_reads:  # a prefetch brings rows this lookup would read again
                self._tier_read_done.wait()
            stamp = self.clock.stamp(tick, self.last_access[:self.size])
            rows = self.index.find_gather(ids, kernel_view(self.weights), out, self.last_access,
                                          stamp, positions)
            self.found(ids, rows, insert, tick, stamp, out, positions)

    def found(self, ids: np.ndarray, rows: np.ndarray, insert: bool, tick: int, stamp: int,
              out: np.ndarray, positions: np.ndarray | None) -> np.ndarray:
        """:meth:`lookup` once the index gave the ``rows`` of ``ids`` (found ones copied to
        ``out``, a kernel view, and stamped ``stamp``); the caller holds ``lock``. Returns
        the rows of ``ids`` after it (-1: not stored)."""
        num_missing = int(np.count_nonzero(rows < 0))
        if self.frequency is not None:
            self.frequency.seen_enough(ids, 0)
        if num_missing and self.tier is not None and self.tier.num_rows:
            back = rows < 0
            rows = self._bring_back(ids, rows, stamp)
            at = np.flatnonzero(back & (rows >= 0))
            if at.shape[0]:
                self.disk_answered += at.shape[0]
                kernels.gather_rows_at(kernel_view(self.weights), rows[at],
                                       at if positions is None else positions[at], out,
                                       self.last_access, stamp)
                num_missing = int(np.count_nonzero(rows < 0))
        self.hits += ids.shape[0] - num_missing
        self.misses += num_missing
        if num_missing and insert:
            # Found rows are copied (this tick's stamp keeps them from eviction); the new ones:
            new = np.flatnonzero(rows < 0)
            rows = self._insert_missing(ids, rows, tick, stamp)
            at = new if positions is None else positions[new]
            # The weights again: arrays that could not be reserved grow by moving.
            kernels.gather_rows_at(kernel_view(self.weights), rows[new], at, out,
                                   self.last_access, stamp)
        return rows

    def prefetch(self, ids: np.ndarray, tick: int) -> int:
        """Bring the rows of ``ids`` absent from RAM that the tier holds back into RAM,
        stamped ``tick``, counted as sightings (they will be looked up); evicts as a
        lookup does, and spares rows of the latest stamp (a batch between its lookup and
        its update) where they leave room. The disk is read with the lock released, so
        updates go on meanwhile (lookups wait: they would read the same rows); a row moved
        in that time stays where it went. Returns how many came back."""
        tier = self.tier
        with self.lock:
            rows = self.index.find(ids)
            if tier is None or not tier.num_rows or bool((rows >= 0).all()):
                return 0
            if self.frequency is not None:
                self.frequency.seen_enough(ids, 0)
            read = tier.plan_read(unique_in_order(ids[rows < 0])[0])
            self._tier_reads += 1
        try:
            records = tier.read_planned(read)  # the disk's wait, without the lock
            with self.lock:
                found, weights, state = tier.take_read(read, records)
                if found.any():
                    stamp = self.clock.stamp(tick, self.last_access[:self.size])
                    spare = np.flatnonzero(self.last_access[:self.size] == stamp)
                    rows = self.index.find(ids)
                    touched = rows[rows >= 0]
                    if spare.shape[0] + ids.shape[0] <= self.share // 2:
                        touched = np.concatenate([touched, spare])
                    self._install(read.ids[found], weights, state, stamp, touched)
                return int(np.count_nonzero(found))
        finally:  # lookups waiting for this read go on, and find its rows in RAM
            with self.lock:
                self._tier_reads -= 1
                self._tier_read_done.notify_all()

    def _bring_back(self, ids: np.ndarray, rows: np.ndarray, stamp: int) -> np.ndarray:
        """Move the rows of ``ids`` absent from RAM (``rows`` -1) that the tier holds into
        RAM, stamped ``stamp``, evicting (spilling) others if the share is full but never
        rows of ``ids``; returns ``rows`` with theirs filled in."""
        tier = self.tier
        assert tier is not None
        missing = rows < 0
        wanted, inverse = unique_in_order(ids[missing])
        found, weights, state = tier.take(wanted)
        if weights.shape[0] == 0:
            return rows
        hit_rows = rows[~missing]
        new_rows, remap = self._install(wanted[found], weights, state, stamp, hit_rows)
        if remap is not None:
            rows[~missing] = remap[hit_rows]
        per_wanted = np.full(wanted.shape[0], -1, np.int64)
        per_wanted[found] = new_rows
        rows[missing] = per_wanted[inverse]
        return rows

    def _install(self, back_ids: np.ndarray, weights: np.ndarray, state: np.ndarray,
                 stamp: int, touched: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Put rows taken from the tier into RAM, stamped ``stamp``, evicting (spilling)
        others if the share is full but never rows ``touched``; returns their rows and
        the eviction's old -> new rows (None: none)."""
        assert self.tier is not None
        n_back = back_ids.shape[0]
        remap = None
        try:
            overflow = self.size + n_back - self.share
            if overflow > 0:
                remap = self._evict(overflow, n_back, touched)
        except BaseException:
            self.tier.write(back_ids, weights, state, fresh=True)  # refused before anything moved
            raise
        self._reserve(self.size + n_back)
        start, end = self.size, self.size + n_back
        new_rows, is_new = self.index.find_or_insert(back_ids, start)
        assert bool(is_new.all()), "a row brought back from disk was also in RAM"
        self.weights[start:end] = weights
        self.state[start:end] = state
        self.last_access[start:end] = stamp
        self.size = end
        self.restored += n_back
        return new_rows, remap

    def _insert_missing(self, ids: np.ndarray, rows: np.ndarray, tick: int, stamp: int
                        ) -> np.ndarray:
        found, missing = rows >= 0, rows < 0
        hit_rows = rows[found]  # stamped ``stamp`` already, as they were copied out
        new_ids, inverse = unique_in_order(ids[missing])
        keep = self.admission.admit(new_ids, tick)
        admitted = new_ids if keep.all() else new_ids[keep]
        n_new = admitted.shape[0]
        self.rejected += new_ids.shape[0] - n_new
        self.admitted += n_new
        if n_new == 0:
            return rows
        overflow = self.size + n_new - self.share
        if overflow > 0:
            remap = self._evict(overflow, n_new, hit_rows)
            rows[found] = remap[hit_rows]
        self._reserve(self.size + n_new)
        start, end = self.size, self.size + n_new
        new_rows, is_new = self.index.find_or_insert(admitted, start)
        assert bool(is_new.all()), "an id missing a moment ago was found on insert"
        table = self.table
        initial = initial_rows(admitted, table.dim, table.init_lower, table.init_upper, table.seed,
                               out=self.weights[start:end] if table.row_dtype == "float32" else None)
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

    def _evict(self, overflow: int, n_new: int, touched: np.ndarray) -> np.ndarray:
        """Drop at least ``overflow`` least-recently-used rows (with a tier: least
        frequent, then least recent), never rows ``touched`` (the batch's own); returns
        old->new rows."""
        size = self.size
        # Rows the batch touches rank after every other (a stamp is coarser than one
        # lookup once the shard's rows span many: its own would not tell them apart).
        order = self.last_access[:size].astype(np.int32)
        if self.frequency is not None:  # least frequent first (uint8 above the stamp)
            order |= self.frequency.estimate(self.ids[:size]).astype(np.int32) << 16
        order[touched] = _TOUCHED
        candidates = int(np.count_nonzero(order < _TOUCHED))
        if candidates < overflow:
            raise ValueError(
                f"one batch needs {n_new} new rows plus {size - candidates} rows it "
                f"touches in one internal shard, over its share of {self.share} rows; "
                f"raise capacity (now {self.table.capacity}) or send smaller batches")
        count = min(max(overflow, self.share // _EVICT_FRACTION), candidates)
        victims = np.argpartition(order, count - 1)[:count]
        if self.tier is None:
            self.evicted += count
            return self._remove(victims)
        self._spill(victims)
        return self._remove(victims, removed=False)

    def _spill(self, victims: np.ndarray) -> None:
        """Write rows ``victims`` to the tier; rows the tier drops to make room are gone
        from the table: counted as evicted (and logged as removed)."""
        assert self.tier is not None
        victims = np.sort(victims)  # sequential gathers, whole rows (np.take)
        ticks = (None if self.tier.stamps is None
                 else self.clock.absolute(self.last_access[victims]))
        ids, weights, state = (np.take(a, victims, axis=0)
                               for a in (self.ids, self.weights, self.state))
        gone = self.tier.write(ids, weights, state, ticks, fresh=True)  # RAM or disk, not both
        self.spilled += victims.shape[0]
        self.evicted += gone.shape[0]
        if gone.shape[0]:
            self._log_removed(gone)

    def expire(self, cutoff: int, disk_cutoff: int = 0, *, spill: bool = False) -> None:
        """Remove every row in RAM last touched before clock value ``cutoff`` (0: none)
        or, with ``spill``, move them to the disk tier; then remove every row on the
        tier last touched before ``disk_cutoff`` (0: none)."""
        with self.lock:
            victims = (np.flatnonzero(self.last_access[:self.size] < self.clock.cutoff(cutoff))
                       if cutoff > 0 else np.zeros(0, np.int64))
            if victims.shape[0] and spill and self.tier is not None:
                self._spill(victims)
                self._remove(victims, removed=False)
            elif victims.shape[0]:
                self.expired += victims.shape[0]
                self._remove(victims)
            if disk_cutoff > 0 and self.tier is not None:
                gone = self.tier.expire(disk_cutoff)
                self.expired += gone.shape[0]
                if gone.shape[0]:
                    self._log_removed(gone)

    def _remove(self, victims: np.ndarray, *, removed: bool = True) -> np.ndarray:
        """Delete rows ``victims`` (distinct) from RAM, compacting; returns old -> new row
        (-1: gone). ``removed``: they leave the table (logged for increments), rather than
        moving to the disk tier."""
        size = self.size
        count = victims.shape[0]
        gone = self.ids[victims].copy() if self.changes.tracking and removed else None
        keep = np.ones(size, dtype=np.bool_)
        keep[victims] = False
        n_keep = size - count
        # Fill holes below n_keep with survivors from above it: moves only ``count``
        # rows instead of shifting everything down.
        holes = np.sort(victims[victims < n_keep])
        movers = np.flatnonzero(keep[n_keep:]) + n_keep
        self._removed_since_rekey += count
        if self._removed_since_rekey < n_keep:  # the index edited: O(count) probes
            self.index.delete(self.ids[victims])
            self.index.repoint(self.ids[movers], holes)
        for array in (self.ids, self.weights, self.state, self.last_access):
            array[holes] = array[movers]
        remap = np.arange(size, dtype=np.int64)
        remap[victims] = -1
        remap[movers] = holes
        self.size = n_keep
        if self._removed_since_rekey >= n_keep:
            # Rebuilt under a new key once as many rows have left as remain, so that a
            # key never outlives the rows' turnover (hash_index: keys are not to be learned).
            self._removed_since_rekey = 0
            self.index.rebuild(self.ids[:n_keep], np.arange(n_keep, dtype=np.int64),
                               room=size)
        # A pass over the rows like this one: the stamps' unit may be finer without the
        # oldest rows.
        self.clock.rebase(self.clock.latest, self.last_access[:n_keep])
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
        self.changes.log_changed(ids, 4 * max(self.size, INITIAL_ROWS))

    def _log_removed(self, ids: np.ndarray) -> None:
        self.changes.log_removed(ids, 4 * max(self.share // _EVICT_FRACTION, INITIAL_ROWS),
                                 lambda merged: self.index.find(merged) >= 0)

    def take_changes(self) -> tuple[np.ndarray, ...]:
        """Copies of the rows changed since the last call (ids, weights, state, last
        access) of those still stored, and the ids removed since (evicted or expired) and
        not stored again: disjoint from the rows' ids. The logs start again empty."""
        with self.lock:
            ids, removed = self.changes.take()
            rows = self.index.find(ids)
            on_disk = ids[rows < 0]
            rows = rows[rows >= 0]
            removed = removed[self.index.find(removed) < 0]
            parts = (*(np.take(a, rows, axis=0) for a in (self.ids, self.weights, self.state)),
                     self.clock.absolute(self.last_access[rows]))
            if self.tier is None:
                return (*parts, removed)
            # A row changed, then spilled, is still exported (read back from disk).
            found, weights, state, stamps = self.tier.peek_stamped(on_disk)
            removed = removed[~self.tier.holds(removed)]
            return (*self._with_disk_rows(parts, on_disk[found], weights, state, stamps),
                    removed)

    def _with_disk_rows(self, parts: tuple[np.ndarray, ...], ids: np.ndarray,
                        weights: np.ndarray, state: np.ndarray, stamps: np.ndarray | None
                        ) -> tuple[np.ndarray, ...]:
        """``parts`` (ids, weights, state, absolute last access) followed by rows from the
        tier, stamped with their last access where it keeps it (a TTL), else the oldest
        unit (they left RAM as least recently used)."""
        if stamps is None:
            stamps = self.clock.absolute(np.zeros(ids.shape[0], self.last_access.dtype))
        return followed_by(parts, (ids, weights, state, stamps))

    def remove_ids(self, ids: np.ndarray) -> int:
        """Delete the rows of ``ids`` (distinct) that are stored; returns how many."""
        with self.lock:
            rows = self.index.find(ids)
            on_disk = 0 if self.tier is None else self.tier.delete(ids[rows < 0])
            rows = rows[rows >= 0]
            if rows.shape[0]:
                self._remove(rows)
            return int(rows.shape[0]) + on_disk

    def update(self, ids: np.ndarray, grads: np.ndarray, tick: int) -> int:
        """One optimizer step on the stored rows of ``ids`` (repeats summed first) at lookup
        ``tick``; returns how many distinct rows were stepped."""
        with self.lock:
            stamp = self.start_update(ids, tick)
            rows = self.index.find(ids)
            if self.tier is not None and self.tier.num_rows and bool((rows < 0).any()):
                rows = self._bring_back(ids, rows, stamp)
            return self.step_rows(ids, rows, grads, stamp)

    def start_update(self, ids: np.ndarray, tick: int) -> int:
        """Log ``ids`` as changed; ``tick`` as a stamp. The caller holds ``lock``."""
        self._log_changes(ids)
        return self.clock.stamp(tick, self.last_access[:self.size])

    def step_rows(self, ids: np.ndarray, rows: np.ndarray, grads: np.ndarray, stamp: int) -> int:
        """:meth:`update`'s step on ``rows`` (of ``ids``; -1: skipped). Holding ``lock``."""
        rows, grads, merged = kernels.sum_duplicate_rows(rows, kernel_view(grads), self.size)
        if merged and self.table.row_dtype != "float32":
            ids = self.ids[rows]  # the ids of the distinct rows, which key rounding
        return self.table.row_step(self.weights, self.state, rows, grads, self.last_access,
                                   stamp, ids)

    def copy_rows(self) -> tuple[np.ndarray, ...]:
        """Copies of every stored row: ids, weights, state and last access (absolute)."""
        with self.lock:
            n = self.size
            parts = (self.ids[:n].copy(), self.weights[:n].copy(), self.state[:n].copy(),
                     self.clock.absolute(self.last_access[:n]))
            if self.tier is None or not self.tier.num_rows:
                return parts
            return self._with_disk_rows(parts, *self.tier.scan_stamped())

    def check_fits(self, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """Rows of ``ids`` (-1: absent) and how many are absent; ValueError if storing
        them would exceed the shard's share. The caller holds ``lock``."""
        rows = self.index.find(ids)
        n_new = int(np.count_nonzero(rows < 0))
        if self.tier is None:
            if self.size + n_new > self.share:
                raise ValueError(f"{self.size + n_new} rows do not fit one internal shard's share of "
                                 f"{self.share} (capacity {self.table.capacity}); raise capacity")
            return rows, n_new
        disk_free = (self.tier.capacity_rows - self.tier.num_rows
                     + int(self.tier.holds(ids[rows < 0]).sum()))
        if self.size + n_new > self.share + disk_free:
            raise ValueError(f"{self.size + n_new} rows do not fit one internal shard's share of "
                             f"{self.share} (capacity {self.table.capacity}) and the {disk_free} "
                             f"rows free in its disk tier; raise capacity or the disk tier's capacity_rows")
        return rows, n_new

    def store_rows(self, ids: np.ndarray, pos: np.ndarray, weights: np.ndarray,
                   state: np.ndarray, stamps: np.ndarray, clock: int) -> None:
        """Store rows ``pos`` of an import (checked: distinct ids of this shard, weights of the table's
        type), overwriting stored rows of the same ids; ``stamps``: absolute, at most ``clock``."""
        part = ids[pos]
        with self.lock:
            # Checked again under the lock: concurrent training lookups may have taken room meanwhile.
            rows, n_new = self.check_fits(part)
            new = rows < 0
            if self.tier is not None:
                self.tier.delete(part[new], counted=False)  # replaced by the import
                if self.size + n_new > self.share:
                    # The most recently used new rows in RAM, the others on disk.
                    new_at = np.flatnonzero(new)
                    order = np.argsort(-stamps[pos[new_at]], kind="stable")
                    to_disk = new_at[order[self.share - self.size:]]
                    self.tier.write(part[to_disk], weights[pos[to_disk]], state[pos[to_disk]],
                                    stamps[pos[to_disk]])
                    keep = np.isin(np.arange(pos.shape[0]), to_disk, invert=True)
                    pos, part, rows, new = pos[keep], part[keep], rows[keep], new[keep]
                    n_new -= to_disk.shape[0]
            # The rows stored so far: a rebase for the import re-stamps them.
            units = self.clock.relative(stamps[pos], clock, self.last_access[:self.size])
            self._reserve(self.size + n_new)
            rows[new] = self.index.find_or_insert(part[new], self.size)[0]
            self.size += n_new
            self.ids[rows] = part
            kernels.scatter_rows(kernel_view(self.weights), rows, kernel_view(weights), pos)
            kernels.scatter_rows(self.state, rows, state, pos)
            self.last_access[rows] = units

"""``DiskTier``: rows of one internal shard that left RAM, in a log of fixed-size records.

When a shard with a tier is full, the rows it evicts are *spilled* here (weights as
stored, optimizer state) instead of being deleted, and a lookup or update of a spilled
id brings its row back into RAM (:class:`persia_py.servers.shard.Shard`), deleting it here.

Layout (measured against LMDB and RocksDB first: docs/benchmarks.md, "Disk tier").

* **Records.** ``id`` (uint64), the weights' bits, the float32 state: a packed numpy
  record of ``8 + dim x bytes per weight + 4 x state width`` bytes (140 B at dim 64,
  float16, row-wise Adagrad). Records are packed into *blocks*, the smallest multiple
  of the 512-byte sector that holds one; a block holds ``block // record`` of them and
  no record straddles two, so a read of one row fetches one block: read amplification
  ``block / record`` (3.7x at 140 B; 11.6x for a 44-byte row, where a sector is the
  floor of what a disk reads).
* **A log of segments.** The file is cut into segments of whole blocks (8 MiB, or 1/64
  of the file where that is less). A spill (a batch: at least 1/16 of the
  shard's share) is written at the head, sequentially, as whole blocks (the block the
  head is in is written again with its earlier records, kept in RAM), one ``pwrite`` per
  8 MiB, filling the open segment. A record whose row went back to RAM is dead. When the
  open segment is full, the segment with the fewest live rows is opened next: its live
  rows are read (one sequential read) and written again at its start (compaction), and
  the head goes on after them. Picking the emptiest segment rather than the oldest
  leaves segments of cold rows, which never come back, where they are: under a skewed
  stream they hold most of the disk's rows, and a circular log would move them all once
  per turn.
* **Free space kept in reserve.** ``capacity_rows`` counts live rows; the file has
  ``capacity_rows / (1 - free_fraction)`` slots, so at most ``1 - free_fraction`` of them
  are ever live, the emptiest segment is at least ``free_fraction`` free, and a write
  moves at most ``(1 - f) / f`` live rows per row it stores (``f = free_fraction``: 7 at
  the default 1/8, 2 at 1/3), however full the disk is; under a skewed stream far fewer
  (docs/benchmarks.md, "Disk tier"). The price is disk space: ``1 / (1 - f)`` times the
  live rows' blocks. Only a full disk (``capacity_rows`` live) deletes rows: those of
  the segments opened longest ago first, counted (:attr:`DiskTier.num_evicted`; the
  shard also logs their ids as removed for incremental exports).
* **RAM index.** :class:`persia_py.servers.tier_index.TierIndex`: a 32-bit fingerprint
  of the id per slot (the id is in the record, and every read checks it) and a hash
  index from fingerprint to slot, 12-14 B per disk row (its module says how).

Crash safety: the tier is a cache of rows not in RAM, in an unnamed file
(:mod:`persia_py.servers.page_file`): after a crash or a restart it starts empty, by
construction (there is no file to reopen, so no stale or torn one). What survives a
crash is what the checkpoint and the update log hold. Checkpoints hold every row, RAM
and disk (:meth:`DiskTier.scan_chunks`; a load appends what does not fit in RAM here:
:meth:`DiskTier.append`). Rows are not checksummed: each read
checks that the record holds the id asked for, or another id of the slot's fingerprint
(a false positive of the fingerprint: the id is absent), else raises
:class:`CorruptTier`. :meth:`DiskTier.holds` and :meth:`DiskTier.delete` read the
records of the ids whose fingerprint they find, for the same reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Executor, Future

import numpy as np

from persia_py.ids.routing import RESERVED_ID
from persia_py.servers import tier_reads, tier_scan
from persia_py.servers.disk_expiry import DiskStamps
from persia_py.servers.page_file import PageFile
from persia_py.servers.tier_index import FREE, CorruptTier, TierIndex
from persia_py.servers.tier_records import (
    SEGMENT_BYTES,
    BlockStager,
    byte_columns,
    file_geometry,
    pack_blocks,
    record_layout,
)

__all__ = ["DEFAULT_FREE_FRACTION", "EMPTY", "CorruptTier", "DiskTier", "file_geometry",
           "record_layout"]

DEFAULT_FREE_FRACTION = 1 / 8
"""Share of the file's slots kept free by default: a write moves at most 7 live rows per
row it stores (measured under Zipf(1.05): 1.4, docs/benchmarks.md "Disk tier"), and a full
disk takes 1.48x its rows' bytes at dim 64 float16 row-wise Adagrad (issue 42: <= 1.5x)."""

EMPTY = np.uint64(RESERVED_ID)
"""Id of a record that holds no row (the reserved id is never stored)."""


class DiskTier:
    """Spilled rows of one shard; not thread-safe (the shard's lock serializes calls)."""

    def __init__(self, directory: str, *, capacity_rows: int, dim: int,
                 weight_dtype: np.dtype, state_width: int, queue_depth: int = 32,
                 free_fraction: float = DEFAULT_FREE_FRACTION, fingerprint_bits: int = 32,
                 stamped: bool = False) -> None:
        if not isinstance(capacity_rows, int) or capacity_rows < 1:
            raise ValueError(f"capacity_rows must be an int >= 1, got {capacity_rows!r}")
        if not 0.0 <= free_fraction <= 0.9:
            raise ValueError(f"free_fraction must be in [0, 0.9], got {free_fraction!r}")
        self.dim = dim
        self.weight_dtype = np.dtype(weight_dtype)
        self.state_width = state_width
        self.record, block_bytes, self.rows_per_block = record_layout(
            dim, self.weight_dtype, state_width)
        self.capacity_rows = capacity_rows
        """Most live rows on disk; beyond it the rows spilled longest ago are deleted."""
        self.num_segments, segment_blocks = file_geometry(
            capacity_rows, block_bytes, self.rows_per_block, free_fraction)
        self.segment_slots = segment_blocks * self.rows_per_block
        """Records per segment (whole blocks): the unit that compaction frees."""
        num_blocks = self.num_segments * segment_blocks
        self.num_slots = num_blocks * self.rows_per_block
        """Records the file holds: ``capacity_rows / (1 - free_fraction)``, rounded up to
        whole segments."""
        self.segment_epoch = np.zeros(self.num_segments, np.int64)
        """When each segment was last opened for writing (a count of openings): the
        order in which a full disk deletes."""
        self._num_opened = 0
        self.file = PageFile(directory, block_bytes=block_bytes, num_blocks=num_blocks,
                             queue_depth=queue_depth)
        self.index = TierIndex(self.num_slots, fingerprint_bits)
        self.slot_fp = self.index.slot_fp
        """Per slot: ``FREE`` or the fingerprint of its row's id (:mod:`tier_index`)."""
        self.stamps = DiskStamps(self.num_slots) if stamped else None
        """Last access of each slot's row (``stamped``: the tier has a TTL to keep)."""
        self._latest_tick = 0
        self.head = 0
        """Next slot to write; the segment it is in is open for writes up to its end."""
        self._head_block = np.zeros(block_bytes, np.uint8)
        """The block the head is in, as last written (rewritten whole when the head's next
        write fills it on)."""
        self.stager = BlockStager(block_bytes)
        self._indexing: list[Future] = []
        """Index inserts of :meth:`append`'s rows in its ``indexer``, not waited for yet."""
        self.num_rows = 0
        """Rows on disk now."""
        self.num_written = 0
        """Rows ever spilled here."""
        self.num_read = 0
        """Rows ever read back (brought back to RAM, or scanned for a checkpoint)."""
        self.num_read_random = 0
        """Rows of :attr:`num_read` read by random block reads (not scans): with the
        blocks read, the read amplification."""
        self.num_evicted = 0
        """Rows deleted because the disk was full (its capacity): the oldest spilled."""
        self.num_relocated = 0
        """Live rows moved up to the head by writes (compaction)."""
        self.num_deleted = 0
        """Rows deleted on request (:meth:`delete`)."""
        self.num_expired = 0
        """Rows deleted by a TTL (:meth:`expire`)."""
        self.num_hits = 0
        """Ids asked of :meth:`take` whose row was here (brought back to RAM)."""
        self.num_misses = 0
        """Ids asked of :meth:`take` whose row was not here."""

    def close(self) -> None:
        """Close the file; its disk space is freed (it has no name). Rows on it are gone."""
        self.file.close()

    def flush(self) -> None:
        """Wait for the write :meth:`append` left in flight and the indexing it gave its
        ``indexer``; raises their first error."""
        pending, self._indexing = self._indexing, []
        try:
            for future in pending:
                future.result()
        finally:
            self.file.flush()

    # -- sizes -------------------------------------------------------------------------

    @property
    def ram_bytes(self) -> int:
        """RAM this tier holds for its rows: the slot fingerprints, the index and the
        stamps (a TTL)."""
        return self.index.nbytes + (0 if self.stamps is None else self.stamps.nbytes)

    @property
    def disk_bytes(self) -> int:
        """Bytes of the tier's file (reserved whole at start)."""
        return self.file.nbytes

    def stats(self) -> dict[str, int]:
        """Counters and sizes, by name (see the attributes of the same names)."""
        return {"disk_rows": self.num_rows, "disk_capacity_rows": self.capacity_rows,
                "disk_slots": self.num_slots,
                "disk_written": self.num_written, "disk_read": self.num_read,
                "disk_read_random": self.num_read_random,
                "disk_record_bytes": self.record.itemsize,
                "disk_evicted": self.num_evicted, "disk_deleted": self.num_deleted,
                "disk_expired": self.num_expired,
                "disk_relocated": self.num_relocated, "disk_hits": self.num_hits,
                "disk_misses": self.num_misses, "disk_block_reads": self.file.num_block_reads,
                "disk_bytes_read": self.file.num_bytes_read,
                "disk_block_bytes": self.file.block_bytes, "disk_bytes": self.disk_bytes,
                "disk_ram_bytes": self.ram_bytes,
                "disk_fingerprint_clashes": int(self.index.side_ids.shape[0])}

    # -- writes ------------------------------------------------------------------------

    def write(self, ids: np.ndarray, weights: np.ndarray, state: np.ndarray,
              ticks: np.ndarray | None = None, *, fresh: bool = False) -> np.ndarray:
        """Store rows (``ids`` distinct uint64, ``weights`` ``(n, dim)`` as stored, ``state``
        ``(n, state_width)`` float32, ``ticks`` their last access, int64 absolute: kept
        where :attr:`stamps`; None: the latest tick seen); a stored row of the same id is
        replaced (``fresh``: none is stored, the caller knows, as a shard's spill does: a
        row is in RAM or here, never both; no look-up, which may read false positives'
        blocks). Returns the ids of the rows the log deleted to make room (counted in ``num_evicted``):
        when more rows come than ``capacity_rows``, the first ones of the batch go too."""
        n = ids.shape[0]
        self._check_rows(ids, weights, state)
        if self.stamps is not None:  # the rows' last access, for a TTL
            ticks = (np.full(n, self._latest_tick, np.int64) if ticks is None
                     else np.asarray(ticks, np.int64))
            self._latest_tick = max(self._latest_tick, int(ticks.max()) if n else 0)
        if not fresh:
            self.delete(ids, counted=False)  # a replaced row is not a deletion
        gone: list[np.ndarray] = []
        cap = self.capacity_rows
        if n > cap:  # cannot all fit: the first ones leave at once
            gone.append(ids[:n - cap])
            self.num_evicted += n - cap
            ids, weights, state = (a[n - cap:] for a in (ids, weights, state))
            ticks = None if ticks is None else ticks[n - cap:]
            n = cap
        if n == 0:
            return np.zeros(0, np.uint64)
        over = self.num_rows + n - cap
        if over > 0:  # the disk is full: the rows spilled longest ago leave
            gone.append(self._drop_oldest(over))
        self.num_written += n
        columns = byte_columns(ids, weights, state)
        done = 0
        while done < n:
            room = -self.head % self.segment_slots if self.head else 0
            if room == 0:  # the open segment is full (or none is open yet)
                room = self._open_segment()
            k = min(room, n - done)
            self._write_at(self.head, ids[done:done + k],
                           tuple(c[done:done + k] for c in columns))
            if self.stamps is not None and ticks is not None:
                self.stamps.set(self.head, ticks[done:done + k])
            self.head += k
            done += k
        return np.concatenate(gone) if gone else np.zeros(0, np.uint64)

    def append(self, ids: np.ndarray, weights: np.ndarray, state: np.ndarray,
               ticks: np.ndarray | None = None, *, indexer: Executor | None = None) -> None:
        """Store rows (distinct, none stored here; ``ticks`` their last access, as for
        :meth:`write`) at the head of a tier only ever appended to since it was made: a
        checkpoint's load into a fresh table. One sequential write of whole blocks, no
        segment compacted, no row replaced (:meth:`write` would look for the emptiest
        segment, an O(slots) count, at every segment boundary). The write's last 8 MiB
        may still be in flight on return (the caller packs its next rows meanwhile): any
        other call waits for it; :meth:`flush` raises its error.

        ``indexer``: an executor of one thread that indexes the rows meanwhile (``ids``
        must not change until then): the index's inserts, random accesses over all of
        a load's rows, are most of a load's CPU after the copies, and the next rows'
        packing and writes need not wait for them. Nothing but :meth:`append` may
        be called until :meth:`flush` has waited for them."""
        n = ids.shape[0]
        self._check_rows(ids, weights, state)
        if self.num_rows != self.head or self.head + n > min(self.num_slots,
                                                              self.capacity_rows):
            raise ValueError(f"append: {n} rows do not follow the {self.num_rows} of a tier "
                             f"only appended to, within its {self.capacity_rows} rows")
        if n == 0:
            return
        first, last = self.head // self.segment_slots, (self.head + n - 1) // self.segment_slots
        for seg in range(first, last + 1):  # opened in order, as write() opens empty ones
            if seg > first or self.head % self.segment_slots == 0:
                self._num_opened += 1
                self.segment_epoch[seg] = self._num_opened
        self._write_at(self.head, ids, byte_columns(ids, weights, state), background=True,
                       indexer=indexer)
        if self.stamps is not None:  # the rows' last access, for a TTL
            ticks = (np.full(n, self._latest_tick, np.int64) if ticks is None
                     else np.asarray(ticks, np.int64))
            self._latest_tick = max(self._latest_tick, int(ticks.max()))
            self.stamps.set(self.head, ticks)
        self.head += n
        self.num_written += n

    def _live_per_segment(self) -> np.ndarray:
        return np.count_nonzero(
            self.slot_fp.reshape(self.num_segments, self.segment_slots) != FREE, axis=1)

    def _open_segment(self) -> int:
        """Open the segment with the fewest live rows for writes: its live rows are read
        (one sequential read) and written again at its start (compaction), the head goes
        after them. Returns the free slots it has (> 0: the caller made room)."""
        seg = int(np.argmin(self._live_per_segment()))
        start = seg * self.segment_slots
        self._num_opened += 1
        self.segment_epoch[seg] = self._num_opened
        self.head = start
        live, rows = self._segment_rows(seg)
        if live.shape[0]:
            ticks = None if self.stamps is None else self.stamps.get(live)
            self.index.remove(live)
            self.num_rows -= live.shape[0]
            self.num_relocated += live.shape[0]
            self._write_at(start, np.ascontiguousarray(rows["id"]), byte_columns(rows))
            if ticks is not None:  # rows keep their stamps
                self.stamps.set(start, ticks)  # type: ignore[union-attr]
            self.head = start + live.shape[0]
        room = self.segment_slots - live.shape[0]
        assert room > 0, "a segment opened for writes has no free slot"
        return room

    def _segment_rows(self, seg: int) -> tuple[np.ndarray, np.ndarray]:
        """The live slots of segment ``seg`` and their records (one sequential read)."""
        start = seg * self.segment_slots
        live = np.flatnonzero(self.slot_fp[start:start + self.segment_slots] != FREE) + start
        if not live.shape[0]:
            return live, np.zeros(0, self.record)
        rpb = self.rows_per_block
        data = self.file.read_range(start // rpb, self.segment_slots // rpb)
        records = data[:, :rpb * self.record.itemsize].view(self.record).reshape(-1)
        rows = records[live - start]
        self.index.check_slots(live, rows["id"])
        return live, rows

    def _write_at(self, start: int, ids: np.ndarray, columns: tuple[np.ndarray, ...],
                  background: bool = False, indexer: Executor | None = None) -> None:
        """Write rows ``ids`` (their records' bytes: :func:`tier_records.byte_columns`) at
        free slots ``start .. start + k - 1`` (no wrap), packed straight into the staging
        blocks, up to 8 MiB a ``pwrite`` (``background``: the last one still in flight on
        return), and index them (in ``indexer``: :meth:`append`). A block the head is
        inside is written again whole, its earlier records from :attr:`_head_block` (no
        read)."""
        k = ids.shape[0]
        rpb = self.rows_per_block
        assert not self.slot_fp[start:start + k].any(), "a write over live rows"
        per_write = max(1, SEGMENT_BYTES // self.file.block_bytes) * rpb
        done = 0
        while done < k:
            at = start + done
            skip = at % rpb
            take = min(k - done, per_write - skip)
            blocks = self.stager.blocks(-(-(skip + take) // rpb))
            pack_blocks(blocks, self._head_block, skip,
                        tuple(c[done:done + take] for c in columns), rpb)
            self.file.write_blocks(at // rpb, blocks, wait=not background)
            self._head_block = blocks[-1].copy()
            done += take
        slots = np.arange(start, start + k, dtype=np.int64)
        if indexer is None:
            self.index.add(ids, slots)
        else:
            self._indexing.append(indexer.submit(self.index.add, ids, slots))
        self.num_rows += k

    def _drop_oldest(self, count: int) -> np.ndarray:
        """Delete ``count`` rows, those of the segments written longest ago first (in
        slot order within one; their ids read from disk); returns their ids, counted in
        ``num_evicted``."""
        gone = []
        for seg in np.argsort(self.segment_epoch, kind="stable"):
            live, rows = self._segment_rows(int(seg))
            live, ids = live[:count], np.ascontiguousarray(rows["id"][:count])
            self.index.remove(live)
            self.num_rows -= live.shape[0]
            self.num_evicted += live.shape[0]
            gone.append(ids)
            count -= live.shape[0]
            if count <= 0:
                break
        return np.concatenate(gone)

    def holds(self, ids: np.ndarray) -> np.ndarray:
        """Whether each id's row is on disk (reads the records of the ids whose
        fingerprint is indexed, to tell a false positive)."""
        return self._locate(ids)[0]

    def delete(self, ids: np.ndarray, *, counted: bool = True) -> int:
        """Delete the stored rows of ``ids`` (distinct); returns how many were stored."""
        _, slots, _ = self._locate(ids)
        self.index.remove(slots)
        self.num_rows -= slots.shape[0]
        if counted:
            self.num_deleted += slots.shape[0]
        return int(slots.shape[0])

    def expire(self, cutoff: int) -> np.ndarray:
        """Delete the rows last accessed before tick ``cutoff`` (a TTL; none without
        :attr:`stamps`); returns their ids (read from their records), counted in
        ``num_expired``."""
        if self.stamps is None or not self.num_rows:
            return np.zeros(0, np.uint64)
        slots = np.flatnonzero(self.stamps.older_than(cutoff) & (self.slot_fp != FREE))
        if not slots.shape[0]:
            return np.zeros(0, np.uint64)
        ids = np.ascontiguousarray(tier_reads.records_at(self, slots)["id"])
        self.index.check_slots(slots, ids)
        self.index.remove(slots)
        self.num_rows -= slots.shape[0]
        self.num_expired += slots.shape[0]
        return ids

    # -- reads -------------------------------------------------------------------------

    def take(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Read and delete the stored rows of ``ids`` (distinct uint64): ``(found,
        weights, state)``, ``found`` a bool mask over ``ids`` and the rows of the found
        ones, in their order. Disk reads: one block per distinct block, in one batch."""
        read = tier_reads.plan(self, ids)
        return self.take_read(read, tier_reads.fetch(self, read), recheck=False)

    def plan_read(self, ids: np.ndarray) -> tier_reads.PlannedRead:
        """Where the rows of ``ids`` (distinct) may be: for :meth:`read_planned` without
        the shard's lock, then :meth:`take_read` (:mod:`persia_py.servers.tier_reads`)."""
        return tier_reads.plan(self, ids)

    def read_planned(self, read: tier_reads.PlannedRead) -> np.ndarray:
        """The records :meth:`plan_read` located, read from disk; the only call here
        made without the shard's lock."""
        return tier_reads.fetch(self, read, locked=False)

    def take_read(self, read: tier_reads.PlannedRead, records: np.ndarray, *,
                  recheck: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`take` of the planned ids whose ``records`` are still their rows
        (``recheck``: read without the lock; the others count as not found)."""
        found, slots, rows = tier_reads.settle(self, read, records, recheck=recheck)
        self.index.remove(slots)
        self.num_rows -= slots.shape[0]
        self.num_hits += slots.shape[0]
        self.num_misses += read.ids.shape[0] - slots.shape[0]
        return (found, *self._columns(rows))

    def peek(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`take` without deleting the rows."""
        return self.peek_stamped(ids)[:3]

    def peek_stamped(self, ids: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """:meth:`peek`, and the found rows' last access (absolute ticks; None where the
        tier keeps no :attr:`stamps`)."""
        found, slots, rows = self._locate(ids)
        return (found, *self._columns(rows),
                None if self.stamps is None else self.stamps.get(slots))

    def _locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(found, slots, rows)``: which ids are stored, and the slots and records of
        those, read from disk (one block per distinct block, in one batch)."""
        read = tier_reads.plan(self, ids)
        return tier_reads.settle(self, read, tier_reads.fetch(self, read))

    def _columns(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Weights and state of records read by random reads (counted as such)."""
        self.num_read += rows.shape[0]
        self.num_read_random += rows.shape[0]
        if rows.shape[0] == 0:
            return (np.zeros((0, self.dim), self.weight_dtype),
                    np.zeros((0, self.state_width), np.float32))
        state = (np.ascontiguousarray(rows["state"]) if self.state_width
                 else np.zeros((rows.shape[0], 0), np.float32))
        return np.ascontiguousarray(rows["weights"]), state

    def scan(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every stored row, ``(ids, weights, state)``, in log order; sequential reads of
        the whole log (:meth:`scan_chunks`, concatenated)."""
        return self.scan_stamped()[:3]

    def scan_stamped(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """:meth:`scan`, and the rows' last access (absolute ticks; None where the tier
        keeps no :attr:`stamps`)."""
        parts = [tuple(None if a is None else a.copy() for a in chunk)  # buffers reused
                 for chunk in self.scan_chunks()]
        if not parts:
            return (np.zeros(0, np.uint64), np.zeros((0, self.dim), self.weight_dtype),
                    np.zeros((0, self.state_width), np.float32),
                    None if self.stamps is None else np.zeros(0, np.int64))
        ids, weights, state = (np.concatenate([p[k] for p in parts]) for k in range(3))
        stamps = None if self.stamps is None else np.concatenate([p[3] for p in parts])
        return ids, weights, state, stamps

    def scan_chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray,
                                            np.ndarray | None]]:
        """Every stored row as ``(ids, weights, state, last access)`` chunks in log order
        (:func:`persia_py.servers.tier_scan.scan_chunks`)."""
        return tier_scan.scan_chunks(self)

    def _check_rows(self, ids: np.ndarray, weights: np.ndarray, state: np.ndarray) -> None:
        n = ids.shape[0]
        if ids.dtype != np.uint64 or ids.ndim != 1:
            raise ValueError("ids must be a 1-D uint64 array")
        if weights.dtype != self.weight_dtype or weights.shape != (n, self.dim):
            raise ValueError(f"weights must be {self.weight_dtype} of shape ({n}, {self.dim}),"
                             f" got {weights.dtype} {weights.shape}")
        if state.dtype != np.float32 or state.shape != (n, self.state_width):
            raise ValueError(f"state must be float32 of shape ({n}, {self.state_width}), got "
                             f"{state.dtype} {state.shape}")

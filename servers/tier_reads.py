"""Random reads of a :class:`persia_py.servers.disk_tier.DiskTier`'s records, in three
steps, so that the disk's wait can happen without the shard's lock.

1. :func:`plan` (lock held): the candidate slot of each id (RAM only), the distinct
   blocks that hold them, and the *epoch* of each slot's segment (when it was last
   opened for writes); any write still in flight is waited for first.
2. :func:`fetch`: the blocks read from the file, touching nothing else of the tier, so a
   prefetch (:meth:`persia_py.servers.shard.Shard.prefetch`) runs it with the lock
   released while lookups and updates go on.
3. :func:`settle` (lock held): which records are still the rows planned, checked
   against the ids, and the counters.

Why a record read without the lock is still the row planned when its slot is still live
and its segment's epoch unchanged (``recheck``): a write only fills free slots at the
head of the open segment, which is past every slot live when that segment was opened,
so a live slot is never written over while its segment stays open; a slot freed (the row
went back to RAM, was deleted, expired or dropped by a full disk) reads as free; and a
segment is only ever written below its head again by being opened anew (compaction),
which changes its epoch. The one write that may land in a block being read is the head's
block written again whole, with the same bytes for the records already in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from persia_py.servers.page_file import PageFile
from persia_py.servers.tier_index import FREE, TierIndex


class DiskTier(Protocol):
    """What a read needs of a :class:`persia_py.servers.disk_tier.DiskTier`."""

    file: PageFile
    index: TierIndex
    slot_fp: np.ndarray
    segment_epoch: np.ndarray
    segment_slots: int
    rows_per_block: int
    record: np.dtype


@dataclass(frozen=True)
class PlannedRead:
    """Where the rows of some ids may be, as the tier stood under the shard's lock."""

    ids: np.ndarray
    """The ids asked for (distinct uint64)."""
    candidate: np.ndarray
    """Bool mask over :attr:`ids`: an indexed slot may hold the id."""
    slots: np.ndarray
    """Slot of each candidate."""
    exact: np.ndarray
    """Whether each candidate is certain (side table) rather than a fingerprint match."""
    epochs: np.ndarray
    """Epoch of each candidate slot's segment when planned."""
    blocks: np.ndarray
    """Distinct blocks to read, ascending."""
    where: np.ndarray
    """Position in :attr:`blocks` of each candidate's block."""


def plan(tier: DiskTier, ids: np.ndarray) -> PlannedRead:
    """Plan reading the rows of ``ids`` (the caller holds the shard's lock)."""
    tier.file.flush()  # a read without the lock must not race a write still in flight
    slots, exact = tier.index.candidates(ids)
    candidate = slots >= 0
    slots, exact = slots[candidate], exact[candidate]
    blocks, where = np.unique(slots // tier.rows_per_block, return_inverse=True)
    return PlannedRead(ids, candidate, slots, exact,
                       tier.segment_epoch[slots // tier.segment_slots], blocks, where)


def fetch(tier: DiskTier, read: PlannedRead, *, locked: bool = True) -> np.ndarray:
    """The records of ``read``'s candidate slots, read from disk (one block per distinct
    block, in one batch). ``locked`` False: the caller does not hold the shard's lock
    (nothing of the tier but its file is touched; :func:`settle` counts the reads)."""
    if read.slots.shape[0] == 0 or (not locked and tier.file.closed):
        return np.zeros(0, tier.record)
    data = tier.file.read_blocks(read.blocks, counted=locked, flush=locked)
    return _records(tier, data, read.where, read.slots)


def records_at(tier: DiskTier, slots: np.ndarray) -> np.ndarray:
    """The records of ``slots`` (the caller holds the shard's lock), read from disk: one
    block per distinct block, in one batch."""
    blocks, where = np.unique(slots // tier.rows_per_block, return_inverse=True)
    return _records(tier, tier.file.read_blocks(blocks), where, slots)


def _records(tier: DiskTier, data: np.ndarray, where: np.ndarray, slots: np.ndarray
             ) -> np.ndarray:
    """The records of ``slots`` from ``data``, the blocks read (``where``: each slot's)."""
    rpb = tier.rows_per_block
    # (blocks, rpb) records: a view, as long as it stays 2-D.
    return data[:, :rpb * tier.record.itemsize].view(tier.record)[where, slots % rpb]


def settle(tier: DiskTier, read: PlannedRead, records: np.ndarray, *, recheck: bool = False
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(found, slots, rows)``: which of ``read.ids`` are stored, their slots and records
    (the caller holds the shard's lock). ``recheck``: the records were fetched without
    the lock; those whose slot was freed or whose segment was opened again since the plan,
    or all where the tier was closed since, count as not found (where the row is now, the
    caller's next look will tell)."""
    found = read.candidate.copy()
    slots, exact = read.slots, read.exact
    if recheck and tier.file.closed:  # its table is gone: nothing to keep
        return np.zeros_like(found), slots[:0], np.zeros(0, tier.record)
    if recheck:
        tier.file.count_reads(read.blocks.shape[0])
        still = ((tier.slot_fp[slots] != FREE)
                 & (tier.segment_epoch[slots // tier.segment_slots] == read.epochs))
        found[found] = still
        slots, exact, records = slots[still], exact[still], records[still]
    if slots.shape[0] == 0:
        return found, slots, np.zeros(0, tier.record)
    match = tier.index.verify(slots, exact, records["id"], read.ids[found])
    found[found] = match
    return found, slots[match], records[match]

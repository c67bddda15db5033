"""``TierIndex``: where a disk tier's rows are, in 4 bytes of RAM per slot plus an index.

A disk tier (:mod:`persia_py.servers.disk_tier`) keeps each row's id in its record on
disk, so RAM need not hold it: per log slot this index keeps a 32-bit *fingerprint* of
the id of the row there (``slot_fp``, a keyed hash: 0 a free slot, 1 a row of the side
table below), and a :class:`persia_py.servers.hash_index.HashIndex` from fingerprint to
slot over it. A lookup of an id finds the slot of its fingerprint; the record read
from there then tells whether it holds that id (:meth:`TierIndex.verify`): a *false
positive*, another id with the same fingerprint, costs one block read and answers
"absent" (about ``rows / 2**32`` of the ids asked that are not on disk: 0.02 % at 1M
rows per tier, 2.3 % at 100M).

Two live rows never share a fingerprint in the hash index: a row whose fingerprint
clashes with a live one's (``rows / 2**32`` of the rows written: a few hundred per 10M)
goes to a *side table* instead, sorted arrays of exact ids and their slots, looked up
first. So a fingerprint found in the index is the only live row that has it, and a
verified mismatch proves the id absent. A record whose id does not hash to its slot's
fingerprint (or not to its side entry) is corruption (:class:`CorruptTier`).

RAM per disk row: 4 B per slot (``1 / (1 - free_fraction)`` slots per live row at a
full disk) plus 6.7-8.3 B of hash index per entry, plus entries of rows gone back to
RAM until they outnumber the live ones (then the index is rebuilt from the live slots).
"""

from __future__ import annotations

import secrets

import numpy as np
from numba import njit

from persia_py.ids.hashing import mix64
from persia_py.servers.hash_index import MAX_LOAD, HashIndex

__all__ = ["FREE", "SIDE", "CorruptTier", "TierIndex"]

FREE = np.uint32(0)
"""``slot_fp`` of a slot that holds no row."""
SIDE = np.uint32(1)
"""``slot_fp`` of a slot whose row is in the side table (its fingerprint clashed)."""


@njit(cache=True, nogil=True)
def _first_of_each(fp: np.ndarray) -> np.ndarray:
    """Whether each fingerprint (>= 2) is the first of its value in ``fp``: one pass
    over a scratch open-addressing set of twice its size (a sort took most of an
    insert's time). Fingerprints are keyed hashes: their low bits are the home."""
    n = fp.shape[0]
    size = 16
    while size < 2 * n:
        size *= 2
    seen = np.zeros(size, np.uint32)
    mask = size - 1
    first = np.zeros(n, np.bool_)
    for i in range(n):
        s = int(fp[i]) & mask
        while seen[s] != 0 and seen[s] != fp[i]:
            s = (s + 1) & mask
        if seen[s] == 0:
            seen[s] = fp[i]
            first[i] = True
    return first


class CorruptTier(RuntimeError):
    """A record read back does not hold the id the index says it holds."""


class TierIndex:
    """id -> slot of a tier's ``num_slots`` log slots; its caller serializes calls."""

    def __init__(self, num_slots: int, fingerprint_bits: int = 32) -> None:
        if not 2 <= fingerprint_bits <= 32:
            raise ValueError(f"fingerprint_bits must be in [2, 32], got {fingerprint_bits!r}")
        self._shift = np.uint64(64 - fingerprint_bits)
        """Fewer bits than 32 only make clashes common (tests of the side table)."""
        self.slot_fp = np.zeros(num_slots, np.uint32)
        """Fingerprint of each slot's row (``FREE``, ``SIDE``, or >= 2)."""
        self.index = HashIndex(row_ids=self.slot_fp)
        self._salt = np.uint64(secrets.randbits(64))  # secret: clashes cannot be crafted
        self.side_ids = np.zeros(0, np.uint64)
        """Ids of the rows whose fingerprint clashed, sorted; their slots beside them."""
        self.side_slots = np.zeros(0, np.int64)
        self.num_live = 0
        """Rows indexed (hash index and side table)."""

    @property
    def nbytes(self) -> int:
        return (self.slot_fp.nbytes + self.index.nbytes + self.side_ids.nbytes
                + self.side_slots.nbytes)

    def fingerprints(self, ids: np.ndarray) -> np.ndarray:
        """32-bit keyed fingerprints of ``ids``, each >= 2."""
        fp = (mix64(ids, self._salt) >> self._shift).astype(np.uint32)
        return np.maximum(fp, np.uint32(2), out=fp)

    def candidates(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, exact)``: the slot that may hold each id (-1: none does) and whether
        that is certain (side table) rather than to be verified by the record."""
        n = ids.shape[0]
        exact = np.zeros(n, np.bool_)
        if not self.num_live:
            return np.full(n, -1, np.int64), exact
        slots = self.index.find(self.fingerprints(ids).astype(np.uint64))
        if self.side_ids.shape[0]:
            pos = np.minimum(np.searchsorted(self.side_ids, ids), self.side_ids.shape[0] - 1)
            exact = self.side_ids[pos] == ids
            slots[exact] = self.side_slots[pos[exact]]
        return slots, exact

    def verify(self, slots: np.ndarray, exact: np.ndarray, record_ids: np.ndarray,
               ids: np.ndarray) -> np.ndarray:
        """Which candidates hold their id (bool mask), from the ids of their records;
        raises :class:`CorruptTier` where a record holds neither the id nor one of the
        slot's fingerprint."""
        match = record_ids == ids
        if not match.all():
            bad = ~match & exact
            bad[~match & ~exact] = (self.fingerprints(record_ids[~match & ~exact])
                                    != self.slot_fp[slots[~match & ~exact]])
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise CorruptTier(f"disk tier: slot {int(slots[i])} holds id "
                                  f"{int(record_ids[i])}, the index says {int(ids[i])}; "
                                  f"the tier file is corrupt")
        return match

    def check_slots(self, slots: np.ndarray, record_ids: np.ndarray) -> None:
        """Raise :class:`CorruptTier` unless the records of live ``slots`` hold ids that
        index to them (compaction and scans read records by slot)."""
        fp = self.slot_fp[slots]
        side = fp == SIDE
        ok = self.fingerprints(record_ids) == fp
        if side.any():
            found, exact = self.candidates(record_ids[side])
            ok[side] = exact & (found == slots[side])
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise CorruptTier(f"disk tier: slot {int(slots[i])} holds id "
                              f"{int(record_ids[i])}, which does not index there; the "
                              f"tier file is corrupt")

    def add(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Index rows ``ids`` (distinct, not indexed) at free ``slots``."""
        fp = self.fingerprints(ids)
        keys = fp.astype(np.uint64)
        main = _first_of_each(fp)
        if self.num_live:
            main &= self.index.find(keys) < 0  # none live has it
        num_main = int(np.count_nonzero(main))
        self._room(num_main)
        if num_main == ids.shape[0]:  # no clash: the common case, no copies
            self.index.insert(keys, slots)
        else:
            self.index.insert(keys[main], slots[main])
            self.slot_fp[slots[~main]] = SIDE
            side_ids = np.concatenate([self.side_ids, ids[~main]])
            order = np.argsort(side_ids, kind="stable")
            self.side_ids = side_ids[order]
            self.side_slots = np.concatenate([self.side_slots, slots[~main]])[order]
        self.num_live += ids.shape[0]

    def remove(self, slots: np.ndarray) -> None:
        """Unindex the rows of live ``slots`` (distinct): the slots become free."""
        side = self.slot_fp[slots] == SIDE
        if side.any():
            keep = ~np.isin(self.side_slots, slots[side])
            self.side_ids, self.side_slots = self.side_ids[keep], self.side_slots[keep]
        self.slot_fp[slots] = FREE
        self.num_live -= slots.shape[0]
        num_main = self.num_live - self.side_ids.shape[0]
        if len(self.index) - num_main > max(num_main, 4096):
            self._rebuild(num_main)  # dead entries outnumber live ones

    def reserve(self, k: int) -> None:
        """Size the index for ``k`` more rows at once (a checkpoint's load: grown step by
        step, it would be rehashed some 50 times on the way to millions of rows)."""
        self._rebuild(self.num_live - self.side_ids.shape[0] + k)

    def _room(self, k: int) -> None:
        """Rebuild from the live slots where ``k`` inserts would make the index grow while
        it holds dead entries: a growth rehashes an entry by the fingerprint its slot
        holds *now*, so every dead entry of a free slot would land on one home, a run of
        probes as long as they are many."""
        num, den = MAX_LOAD
        num_main = self.num_live - self.side_ids.shape[0]
        if len(self.index) + k > self.index.slots * num // den and len(self.index) > num_main:
            self._rebuild(num_main + k + num_main // 4)

    def _rebuild(self, room: int) -> None:
        slots = np.flatnonzero(self.slot_fp > SIDE)
        self.index.rebuild(self.slot_fp[slots].astype(np.uint64), slots, room=room)

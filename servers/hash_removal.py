"""Removing and moving entries of a :class:`persia_py.servers.hash_index.HashIndex` in
place, in time proportional to the entries changed rather than to the index.

A shard that evicts ``k`` of its ``n`` rows deletes them from its index and gives the
rows moved into their places (compaction) their new numbers: ``O(k)`` probes, where
rebuilding the index from the survivors costs ``O(n)`` inserts for every eviction.

Deletion from linear probing leaves no tombstone: the entries after the emptied slot,
up to the next empty one, each move back into the hole when their home slot does not
lie cyclically after the hole (*backward-shift deletion*), so every remaining entry
stays reachable from its home and probes stay as short as if it had never been there.
An entry's home is recomputed from its id's keyed hash (its id read from ``row_ids``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from persia_py.ids.hashing import keyed_hash_one
from persia_py.servers.hash_probe import home_and_tag, next_slot, probe
from persia_py.servers.kernels import PREFETCH_AHEAD, prefetch_item


@njit(cache=True, nogil=True, inline="always")
def _moves_back(home: int, hole: int, at: int) -> bool:
    """Whether an entry at slot ``at`` with home ``home`` may fill the hole at ``hole``
    (``at`` comes after ``hole`` in probe order): its home is not cyclically in
    ``(hole, at]``."""
    if hole < at:
        return home <= hole or home > at
    return at < home <= hole


@njit(cache=True, nogil=True)
def delete_kernel(slots: np.ndarray, row_ids: np.ndarray, row_mask: np.uint64,
                  ids: np.ndarray, home: np.ndarray, tags: np.ndarray, words: np.ndarray,
                  tag_mask: np.uint64, row_bits: int) -> int:
    """Remove the entry of every id of ``ids`` present (``home``/``tags``: theirs under
    the index's key ``words``); returns how many were present. ``row_ids`` must still
    hold the id of every row the slots point to."""
    num_slots = slots.shape[0]
    n = ids.shape[0]
    removed = 0
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            prefetch_item(slots, home[i + PREFETCH_AHEAD])
        hole, r = probe(slots, row_ids, ids[i], tags[i], row_mask, home[i])
        if r < 0:
            continue
        removed += 1
        at = next_slot(hole, num_slots)
        while True:
            v = np.uint64(slots[at])
            if v == 0:
                break
            key = row_ids[np.int64(v & row_mask) - 1]
            h = int(home_and_tag(keyed_hash_one(key, words), num_slots, tag_mask, row_bits)[0])
            if _moves_back(h, hole, at):
                slots[hole] = slots[at]
                hole = at
            at = next_slot(at, num_slots)
        slots[hole] = 0
    return removed


@njit(cache=True, nogil=True)
def repoint_kernel(slots: np.ndarray, row_ids: np.ndarray, row_mask: np.uint64,
                   ids: np.ndarray, home: np.ndarray, tags: np.ndarray,
                   rows: np.ndarray) -> int:
    """Point the entry of ``ids[i]`` (present, at the row ``row_ids`` still gives it) at
    row ``rows[i]`` instead; returns the position of an id not present, or -1."""
    n = ids.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            prefetch_item(slots, home[i + PREFETCH_AHEAD])
        s, r = probe(slots, row_ids, ids[i], tags[i], row_mask, home[i])
        if r < 0:
            return i
        slots[s] = tags[i] | np.uint64(rows[i] + 1)
    return -1

"""The probe steps every kernel over a :class:`persia_py.servers.hash_index.HashIndex`
shares: an id's home slot and tag under the index's key, and linear probing from there
(the slot layout is described in :mod:`persia_py.servers.hash_index`)."""

from __future__ import annotations

import numpy as np
from numba import njit

from persia_py.ids.hashing import keyed_hash_one


@njit(cache=True, nogil=True)
def homes_and_tags(ids: np.ndarray, start: int, num_slots: int, words: np.ndarray,
                   tag_mask: np.uint64, row_bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Home slot of every id in ``ids[start:]``, and its tag shifted into place (the slot
    value of the id, less its row)."""
    n = ids.shape[0] - start
    home = np.empty(n, np.int64)
    tags = np.empty(n, np.uint64)
    for i in range(n):
        home[i], tags[i] = home_and_tag(keyed_hash_one(ids[start + i], words), num_slots,
                                        tag_mask, row_bits)
    return home, tags


@njit(cache=True, nogil=True, inline="always")
def home_and_tag(h: np.uint64, num_slots: int, tag_mask: np.uint64, row_bits: int
                 ) -> tuple[np.int64, np.uint64]:
    """The home slot is the hash's top 32 bits scaled to ``num_slots``, the tag its low
    bits: independent (but for uint64 slots, whose tags reach past bit 31)."""
    home = np.int64(((h >> np.uint64(32)) * np.uint64(num_slots)) >> np.uint64(32))
    return home, (h & tag_mask) << np.uint64(row_bits)


@njit(cache=True, nogil=True, inline="always")
def next_slot(s: int, num_slots: int) -> int:
    s += 1
    return 0 if s == num_slots else s


@njit(cache=True, nogil=True, inline="always")
def candidate(slots: np.ndarray, tag: np.uint64, row_mask: np.uint64, s: int
              ) -> tuple[int, int]:
    """``(slot, row)`` of the first slot from ``s`` on whose tag is ``tag``, or of the
    empty slot that ends the probe (row -1). Reads no id."""
    num_slots = slots.shape[0]
    while True:
        v = np.uint64(slots[s])
        if v == 0:
            return s, -1
        if v & ~row_mask == tag:
            return s, np.int64(v & row_mask) - 1
        s = next_slot(s, num_slots)


@njit(cache=True, nogil=True, inline="always")
def probe(slots: np.ndarray, row_ids: np.ndarray, key: np.uint64, tag: np.uint64,
          row_mask: np.uint64, s: int) -> tuple[int, int]:
    """``(slot, row)`` of ``key`` from slot ``s`` on, or of the empty slot where its probe
    ends (row -1)."""
    num_slots = slots.shape[0]
    while True:
        s, r = candidate(slots, tag, row_mask, s)
        if r < 0 or row_ids[r] == key:
            return s, r
        s = next_slot(s, num_slots)

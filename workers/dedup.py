"""Distinct ids of a batch and, per id occurrence, which distinct id it is.

``np.unique(ids, return_inverse=True)`` sorts; a hash table does the same job in one
pass (measured: 26 slots x 20k Zipf ids, 39 ms with np.unique, 13 ms here). The distinct
ids come out in order of first appearance, not sorted.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from persia_py.routing import _GOLDEN, _M1, _M2


@njit(cache=True, nogil=True)
def _unique_inverse_kernel(ids: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    mask = num_slots - 1
    keys = np.empty(num_slots, np.uint64)
    first = np.full(num_slots, -1, np.int64)
    unique = np.empty(ids.shape[0], np.uint64)
    inverse = np.empty(ids.shape[0], np.int64)
    num_unique = 0
    for i in range(ids.shape[0]):
        key = ids[i]
        z = key + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        s = np.int64((z ^ (z >> np.uint64(31))) & np.uint64(mask))
        while True:
            row = first[s]
            if row < 0:
                first[s] = num_unique
                keys[s] = key
                unique[num_unique] = key
                inverse[i] = num_unique
                num_unique += 1
                break
            if keys[s] == key:
                inverse[i] = row
                break
            s = (s + 1) & mask
    return unique[:num_unique], inverse


def unique_inverse(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(unique, inverse)`` with ``unique[inverse] == ids``; unique in first-seen order."""
    ids = np.ascontiguousarray(ids, dtype=np.uint64)
    num_slots = 1 << max(4, int(2 * ids.size).bit_length())  # load factor <= 1/2
    return _unique_inverse_kernel(ids, num_slots)

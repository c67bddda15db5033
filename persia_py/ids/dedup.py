"""Deduplication of ids (and row numbers) in order of first position, with a keyed hash set.

Shared by the embedding worker (distinct ids of a batch) and the parameter server
(distinct new ids, distinct rows of an update, and whether a load's or an import's ids
repeat: :func:`repeated_id`). O(n) with a scratch open-addressing set,
unlike ``numpy.unique``'s sort. The set is hashed with a secret key drawn once per
process (:class:`persia_py.ids.hashing.HashKey`): its input comes from the wire, and with a
public hash ids that all share one slot could be computed offline, making the linear
probing quadratic.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from persia_py.ids.hashing import HashKey, keyed_hash_one

_KEY = HashKey.random()
"""This process's dedup key (an immutable secret, not state carried between calls)."""
_ALL_ONES = np.uint64(0xFFFFFFFFFFFFFFFF)


@njit(cache=True, nogil=True, error_model="numpy")
def _group_in_order(values: np.ndarray, words: np.ndarray, skip_all_ones: bool
                    ) -> tuple[np.ndarray, np.ndarray]:
    """``(unique, inverse)`` with ``values[i] == unique[inverse[i]]``; with
    ``skip_all_ones``, values equal to 2**64-1 get ``inverse`` -1 and no group.

    Every home slot is hashed first, in a loop of its own that vectorizes, so the
    probing loop waits on the table only; the table holds int32 group numbers (half the
    cache of int64 ones; fewer than 2**31 values, which the callers check)."""
    n = values.shape[0]
    slots = 16
    while slots < 2 * n:
        slots *= 2
    mask = np.uint64(slots - 1)
    home = np.empty(n, np.int64)
    for i in range(n):
        home[i] = np.int64(keyed_hash_one(values[i], words) & mask)
    table = np.full(slots, -1, np.int32)  # slot -> group number
    inverse = np.empty(n, np.int64)
    unique = np.empty(n, np.uint64)
    num_unique = 0
    for i in range(n):
        value = values[i]
        if skip_all_ones and value == _ALL_ONES:
            inverse[i] = -1
            continue
        s = home[i]
        while True:
            j = table[s]
            if j < 0:
                table[s] = num_unique
                unique[num_unique] = value
                inverse[i] = num_unique
                num_unique += 1
                break
            if unique[j] == value:
                inverse[i] = j
                break
            s = (s + 1) & np.int64(mask)
    return unique[:num_unique].copy(), inverse


def _checked(values: np.ndarray) -> np.ndarray:
    if values.ndim != 1 or values.shape[0] >= 2**31:
        raise ValueError(f"expected a 1-D array of fewer than 2**31 values, got shape "
                         f"{values.shape}")
    return values


def unique_in_order(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(unique, inverse)``: distinct ids in order of first position, ``ids == unique[inverse]``.

    ``ids``: 1-D uint64 (every value allowed); ``inverse`` is int64.
    """
    ids = _checked(np.ascontiguousarray(ids, dtype=np.uint64))
    return _group_in_order(ids, _KEY.words, False)


def rows_in_order(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`unique_in_order` of int64 row numbers, where row -1 (not stored) is dropped:
    ``inverse`` is -1 there; ``unique`` is int64."""
    rows = _checked(np.ascontiguousarray(rows, dtype=np.int64))
    unique, inverse = _group_in_order(rows.view(np.uint64), _KEY.words, True)
    return unique.view(np.int64), inverse


@njit(cache=True, nogil=True, error_model="numpy")
def _any_repeat(values: np.ndarray, words: np.ndarray) -> bool:
    """Whether some value of ``values`` occurs twice. The keyed hash is a bijection of
    uint64, so the values repeat where their hashes do: the hashes are spread into
    buckets of ~256 by their top bits (a counting pass, then a scatter), and each
    bucket is checked with a small set that stays in cache, where one set over all the
    values would miss the cache at nearly every probe, and a sort does more work
    (docs/benchmarks.md, "Disk tier")."""
    n = values.shape[0]
    bits = 1
    while (1 << bits) * 256 < n:
        bits += 1
    shift = np.uint64(64 - bits)
    starts = np.zeros((1 << bits) + 1, np.int64)
    for i in range(n):
        starts[np.int64(keyed_hash_one(values[i], words) >> shift) + 1] += 1
    for b in range(1 << bits):
        starts[b + 1] += starts[b]
    fill = starts[:-1].copy()
    spread = np.empty(n, np.uint64)
    for i in range(n):
        h = keyed_hash_one(values[i], words)
        b = np.int64(h >> shift)
        spread[fill[b]] = h
        fill[b] += 1
    size = 16
    table = np.zeros(size, np.uint64)
    used = np.zeros(size, np.bool_)
    for b in range(1 << bits):
        lo, hi = starts[b], starts[b + 1]
        while size < 2 * (hi - lo):
            size *= 2
        if size > table.shape[0]:
            table = np.zeros(size, np.uint64)
            used = np.zeros(size, np.bool_)
        used[:size] = False
        mask = np.uint64(size - 1)
        for j in range(lo, hi):
            h = spread[j]
            s = np.int64(h & mask)  # the low bits: random, unlike the bucket's top bits
            while used[s]:
                if table[s] == h:
                    return True
                s = (s + 1) & np.int64(mask)
            used[s] = True
            table[s] = h
    return False


def repeated_id(ids: np.ndarray) -> int | None:
    """An id that occurs more than once in ``ids`` (1-D uint64), None when all are
    distinct. O(n) over buckets that fit in cache (:func:`_any_repeat`); the sort that
    names the repeated id runs only when there is one."""
    ids = np.ascontiguousarray(ids, dtype=np.uint64)
    if ids.ndim != 1:
        raise ValueError(f"expected a 1-D array, got shape {ids.shape}")
    if not _any_repeat(ids, _KEY.words):
        return None
    ordered = np.sort(ids)
    return int(ordered[1:][ordered[1:] == ordered[:-1]][0])

"""Open-addressing hash map from uint64 id to int64 row number, for one internal shard.

Linear probing over a power-of-two slot array. A slot holds the id's complement
(``~id``), so an all-zero slot is empty and fresh zeroed memory is an empty index with no
fill pass; ``RESERVED_ID`` (all ones) would complement to zero, so it can never be
stored. The load factor is kept at or below one half, which keeps probe sequences short
without a per-slot occupancy array. Each call first hashes the whole batch and only
then probes, so the independent cache misses of the probe loop can overlap instead of
waiting behind hash arithmetic.

The home slot of an id is its keyed hash (:mod:`persia_py.ids.hashing`) under a key secret to
this index: ids are chosen by whoever sends them, and under a public hash they could be
chosen to share one home slot, which makes linear probing quadratic (a flood of such ids
held the shard lock for seconds and left the index slow for good). The key is redrawn
whenever the slot array is rebuilt (growth, eviction), so it never lives long enough to
be learned from timings. ``probe_bound`` reports the longest probe any lookup can make.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from persia_py.ids.hashing import HashKey, keyed_hash_one
from persia_py.ids.routing import RESERVED_ID
from persia_py.servers import memory
from persia_py.servers.kernels import PREFETCH_AHEAD, prefetch_item, prefetch_row

_EMPTY = np.uint64(0)
"""A free slot's key: the complement of ``RESERVED_ID``."""
_FLIP = np.uint64(RESERVED_ID)
"""``key ^ _FLIP`` turns an id into its stored form and back."""


@njit(cache=True, nogil=True)
def _keyed_slots(ids: np.ndarray, start: int, mask: int, words: np.ndarray) -> np.ndarray:
    """Keyed hash of every id in ``ids[start:]``, reduced to a slot number."""
    n = ids.shape[0] - start
    home = np.empty(n, np.int64)
    umask = np.uint64(mask)
    for i in range(n):
        home[i] = np.int64(keyed_hash_one(ids[start + i], words) & umask)
    return home


@njit(cache=True, nogil=True, inline="always")
def _probe(keys: np.ndarray, key: np.uint64, s: int) -> int:
    """The slot holding ``key``, or the empty slot where its probe ends."""
    mask = keys.shape[0] - 1
    while True:
        k = keys[s]
        if k == key or k == _EMPTY:
            return s
        s = (s + 1) & mask


@njit(cache=True, nogil=True)
def _find_kernel(keys: np.ndarray, vals: np.ndarray, ids: np.ndarray, home: np.ndarray
                 ) -> np.ndarray:
    n = ids.shape[0]
    rows = np.empty(n, np.int64)
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            prefetch_item(keys, home[i + PREFETCH_AHEAD])
        s = _probe(keys, ids[i] ^ _FLIP, home[i])
        rows[i] = -1 if keys[s] == _EMPTY else vals[s]
    return rows


@njit(cache=True, nogil=True, error_model="numpy")
def _find_gather_kernel(keys: np.ndarray, vals: np.ndarray, ids: np.ndarray,
                        home: np.ndarray, weights: np.ndarray, out: np.ndarray,
                        positions: np.ndarray, stamps: np.ndarray, tick: int) -> np.ndarray:
    """:func:`_find_kernel` and ``kernels.gather_rows_at`` in one pipelined pass.

    At step ``i`` the slot of id ``i + 2A`` is prefetched, id ``i + A`` (its slot now
    in cache) is probed and its row prefetched, and row ``i`` (in cache by now) is
    copied to ``out[positions[i]]`` (``out[i]`` when ``positions`` is empty), so index
    and row misses of nearby ids overlap. Returns the rows.
    """
    scatter = positions.shape[0] > 0
    n = ids.shape[0]
    dim = weights.shape[1]
    rows = np.empty(n, np.int64)
    for i in range(-PREFETCH_AHEAD, n):
        if i + 2 * PREFETCH_AHEAD < n:
            prefetch_item(keys, home[i + 2 * PREFETCH_AHEAD])
        j = i + PREFETCH_AHEAD
        if j < n:
            s = _probe(keys, ids[j] ^ _FLIP, home[j])
            if keys[s] == _EMPTY:
                rows[j] = -1
            else:
                r = np.int64(vals[s])
                rows[j] = r
                prefetch_row(weights, r)
                prefetch_item(stamps, r)
        if i < 0:
            continue
        r = rows[i]
        p = positions[i] if scatter else i
        if r < 0:
            for d in range(dim):
                out[p, d] = 0.0
            continue
        for d in range(dim):
            out[p, d] = weights[r, d]
        stamps[r] = tick
    return rows


@njit(cache=True, nogil=True)
def _find_or_insert_kernel(
    keys: np.ndarray,
    vals: np.ndarray,
    ids: np.ndarray,
    home: np.ndarray,
    start: int,
    rows: np.ndarray,
    is_new: np.ndarray,
    next_row: int,
    count: int,
    max_count: int,
) -> tuple[int, int, int]:
    """Fill ``rows``/``is_new`` from ``start`` on (``home``: slots of ``ids[start:]``);
    stop before exceeding ``max_count``.

    Returns ``(stopped_at, count, next_row)``; ``stopped_at < len(ids)`` means the
    caller must grow the slot arrays and call again from there.
    """
    n = home.shape[0]
    for j in range(n):
        if j + PREFETCH_AHEAD < n:
            prefetch_item(keys, home[j + PREFETCH_AHEAD])
        i = start + j
        key = ids[i] ^ _FLIP
        s = _probe(keys, key, home[j])
        if keys[s] == key:
            rows[i] = vals[s]
            continue
        if count >= max_count:
            return i, count, next_row
        keys[s] = key
        vals[s] = next_row
        rows[i] = next_row
        is_new[i] = True
        next_row += 1
        count += 1
    return ids.shape[0], count, next_row


@njit(cache=True, nogil=True)
def _insert_all_kernel(keys: np.ndarray, vals: np.ndarray, ids: np.ndarray,
                       home: np.ndarray, rows: np.ndarray) -> int:
    """Insert into empty-enough arrays; returns the position of a duplicate id, or -1."""
    n = ids.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            prefetch_item(keys, home[i + PREFETCH_AHEAD])
        key = ids[i] ^ _FLIP
        s = _probe(keys, key, home[i])
        if keys[s] == key:
            return i
        keys[s] = key
        vals[s] = rows[i]
    return -1


@njit(cache=True, nogil=True)
def _longest_run(keys: np.ndarray) -> int:
    """Longest run of occupied slots, wrapping around (the slot array is never full)."""
    n = keys.shape[0]
    first_empty = 0
    while keys[first_empty] != _EMPTY:
        first_empty += 1
    longest = run = 0
    for step in range(1, n + 1):
        if keys[(first_empty + step) % n] == _EMPTY:
            run = 0
        else:
            run += 1
            longest = max(longest, run)
    return longest


_NO_POSITIONS = np.zeros(0, np.int64)


def _slots_for(entries: int, minimum: int) -> int:
    """Smallest power of two >= ``minimum`` that holds ``entries`` at load <= 1/2."""
    need = max(minimum, 2 * entries, 2)
    return 1 << (need - 1).bit_length()


def _empty_slots(slots: int) -> np.ndarray:
    """``(slots, 2)`` uint64: column 0 the stored key (``_EMPTY``: free), column 1 the row."""
    return memory.zeros((slots, 2), np.uint64)


def _check_ids(ids: np.ndarray, name: str = "ids") -> np.ndarray:
    if not isinstance(ids, np.ndarray) or ids.dtype != np.uint64 or ids.ndim != 1:
        raise ValueError(f"{name} must be a 1-D numpy array of dtype uint64")
    if ids.size and bool((ids == RESERVED_ID).any()):
        raise ValueError(f"{name} contains the reserved id 2**64-1, which cannot be stored")
    return np.ascontiguousarray(ids)


class HashIndex:
    """uint64 id -> int64 row map with linear probing; not thread-safe (callers lock)."""

    def __init__(self, initial_slots: int = 1024) -> None:
        if not isinstance(initial_slots, int) or initial_slots < 1:
            raise ValueError(f"initial_slots must be a positive int, got {initial_slots!r}")
        self._min_slots = _slots_for(0, initial_slots)
        self._reset(self._min_slots)

    def _reset(self, slots: int) -> None:
        self._set_slots(_empty_slots(slots))
        self._count = 0

    def _set_slots(self, pairs: np.ndarray) -> None:
        # A slot's key and row sit side by side (one cache line), so a probe that finds
        # its key has the row too: one random read per id instead of two.
        self._pairs = pairs
        self._keys = pairs[:, 0]
        self._vals = pairs[:, 1].view(np.int64)
        self._key = HashKey.random()  # every new slot array is filled under a new key

    def _home_slots(self, ids: np.ndarray, start: int = 0) -> np.ndarray:
        """Home slot of each id in ``ids[start:]`` (int64)."""
        return _keyed_slots(ids, start, self.slots - 1, self._key.words)

    def __len__(self) -> int:
        return self._count

    @property
    def slots(self) -> int:
        """Number of slots currently allocated (a power of two)."""
        return self._keys.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by the slot arrays."""
        return self._keys.nbytes + self._vals.nbytes

    def probe_bound(self) -> int:
        """Most slots any :meth:`find` reads for one id now: the longest run of occupied
        slots plus the empty slot that ends it. Small (tens) for any input the key was
        not known for; O(slots) to compute, for tests and diagnostics."""
        return _longest_run(self._keys) + 1

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Row of each id (int64), -1 where the id is absent; duplicates are fine."""
        ids = _check_ids(ids)
        return _find_kernel(self._keys, self._vals, ids, self._home_slots(ids))

    def find_gather(self, ids: np.ndarray, weights: np.ndarray, out: np.ndarray,
                    stamps: np.ndarray, tick: int,
                    positions: np.ndarray | None = None) -> np.ndarray:
        """:meth:`find`, copying each found id's row of ``weights`` to ``out`` (row
        ``positions[i]`` of it for id ``i``, or row ``i``; zeros where absent) and setting
        its ``stamps`` entry to ``tick``; returns the rows."""
        ids = _check_ids(ids)
        positions = _NO_POSITIONS if positions is None else positions
        return _find_gather_kernel(self._keys, self._vals, ids, self._home_slots(ids),
                                   weights, out, positions, stamps, tick)

    def find_or_insert(self, ids: np.ndarray, next_row: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``ids``, inserting the absent ones; returns ``(rows, is_new)``.

        New ids get rows ``next_row, next_row + 1, ...`` in the order of their first
        position in ``ids``; callers pass unique ids (a repeat would just get the row of
        its first occurrence, with ``is_new`` False).
        """
        ids = _check_ids(ids)
        if next_row < 0:
            raise ValueError(f"next_row must be >= 0, got {next_row}")
        n = ids.shape[0]
        rows = np.empty(n, dtype=np.int64)
        is_new = np.zeros(n, dtype=np.bool_)
        start = 0
        while True:
            start, self._count, next_row = _find_or_insert_kernel(
                self._keys, self._vals, ids, self._home_slots(ids, start), start, rows,
                is_new, next_row, self._count, self.slots // 2,
            )
            if start >= n:
                return rows, is_new
            # Plain doubling (not sizing for the rest of the batch): most of a batch is
            # usually already present, and doubling keeps rehash cost amortized O(1).
            self._grow(self.slots * 2)

    def _grow(self, slots: int) -> None:
        occupied = self._keys != _EMPTY
        keys, vals = self._keys[occupied] ^ _FLIP, self._vals[occupied]
        self._set_slots(_empty_slots(slots))
        dup = _insert_all_kernel(self._keys, self._vals, keys, self._home_slots(keys), vals)
        assert dup < 0, "hash index held a duplicate key"

    def rebuild(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Replace the whole content with ``ids[i] -> rows[i]`` (ids must be unique)."""
        ids = _check_ids(ids)
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if rows.shape != ids.shape:
            raise ValueError(f"rows must have shape {ids.shape}, got {rows.shape}")
        self._reset(_slots_for(ids.shape[0], self._min_slots))
        dup = _insert_all_kernel(self._keys, self._vals, ids, self._home_slots(ids), rows)
        if dup >= 0:
            self._reset(self._min_slots)
            raise ValueError(f"ids must be unique; id {int(ids[dup])} repeats")
        self._count = ids.shape[0]

"""Open-addressing hash index from uint64 id to int64 row number, for one internal shard.

The index holds row numbers only, not ids: the id of a row lives once, in the table's
``row_ids`` array (row -> id), and a probe that meets a candidate row compares its id
there. Each slot is one uint32 (uint64 for shards too big for that, see below): the row
number plus one in its low ``row_bits`` bits (0: an empty slot, so fresh zeroed memory
is an empty index with no fill pass) and a tag, more bits of the id's hash, in the bits
above. A probe reads ``row_ids`` only where the tag matches, so absent ids (the common
case of an insert) are answered from the slot array alone, and present ones cost one
read of their id, which the lookup kernels prefetch together with the row's weights.

Linear probing over a slot array kept at most 3/5 full: sixteen slots share a cache line.
The slot count is not a power of two: it is one of ``2**e x {4, 5, 6, 7} / 4`` (at
least ``MIN_SLOTS``), and an id's home slot is the top 32 bits of its hash scaled to the
count (multiply and shift, "fastrange") instead of masked. A growth goes to the next
such count, 1.14 to 1.25 times the last, so the load stays between 0.48 and 0.6 and a
row costs 6.7 to 8.3 bytes of index, where doubling a power-of-two array left it
anywhere between 6.7 and 13.3. The price is more rehashing: a row is rehashed about six
times on its way into a large index instead of once or twice, each growth one pass over
the slots with the shard's lock held, shorter than a doubling's but four times as often.
Fuller arrays were tried: at 4/5 the longest runs of occupied slots reach hundreds of
slots (what a crafted-id test bounds), and probes starting at a bucket's first slot
halved in-cache find throughput for the scanning they add.

The home slot and tag are a keyed hash (:mod:`persia_py.ids.hashing`) under a key secret to
this index: ids are chosen by whoever sends them, and under a public hash they could be
chosen to share one home, which makes linear probing quadratic (a flood of such ids held
the shard lock for seconds and left the index slow for good). The key is redrawn
whenever the slot array is rebuilt: at each growth, and by a shard that evicts once as
many rows have left as remain (between, evictions edit the index in place:
:mod:`persia_py.servers.hash_removal`), so it never outlives the rows' turnover and is
not learned from timings. ``probe_bound`` reports the longest probe any lookup can make.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from persia_py.ids.hashing import HashKey, keyed_hash_one
from persia_py.ids.routing import RESERVED_ID
from persia_py.servers import memory
from persia_py.servers.access_clock import STAMP_DTYPE
from persia_py.servers.hash_probe import candidate, home_and_tag, homes_and_tags, next_slot, probe
from persia_py.servers.hash_removal import delete_kernel, repoint_kernel
from persia_py.servers.kernels import PREFETCH_AHEAD, prefetch_item, prefetch_row
from persia_py.servers.row_types import as_answered

MIN_SLOTS = 16
"""Fewest slots of an index: one cache line of uint32 slots."""
MAX_LOAD = (3, 5)
"""Most entries per slot (numerator, denominator) before the slot array grows."""
SIZE_STEPS = 4
"""Slot counts per doubling: ``2**e x {SIZE_STEPS, ..., 2 x SIZE_STEPS - 1} / SIZE_STEPS``."""
MAX_SLOTS = 1 << 32
"""Slot counts stay below this: the home slot scales 32 bits of hash."""
MIN_TAG_BITS = 4
"""Fewest tag bits of a uint32 slot; a shard whose row numbers leave fewer gets uint64
slots (past about 161M rows in one internal shard: 2**28 slots at the load bound)."""


@njit(cache=True, nogil=True, error_model="numpy")
def _find_kernel(slots: np.ndarray, row_ids: np.ndarray, row_mask: np.uint64,
                 ids: np.ndarray, home: np.ndarray, tags: np.ndarray, weights: np.ndarray,
                 out: np.ndarray, positions: np.ndarray, stamps: np.ndarray, tick: int
                 ) -> np.ndarray:
    """Row of every id (-1: absent), in a three-stage pipeline.

    At step ``i`` the home slot of id ``i + 2A`` is prefetched; id ``i + A``'s slots
    (in cache by now) yields its candidate row, whose id and weights are prefetched; id
    ``i``'s candidate is checked against ``row_ids`` (a tag collision probes on) and,
    when ``out`` has rows, its weights are copied to ``out[positions[i]]`` (``out[i]``
    when ``positions`` is empty; converted if ``out`` has another element type:
    :func:`row_types.as_answered`) and its stamp set to ``tick``. Index, id and row misses
    of nearby ids overlap.
    """
    gather = out.shape[0] > 0
    scatter = positions.shape[0] > 0
    n = ids.shape[0]
    dim = weights.shape[1]
    num_slots = slots.shape[0]
    rows = np.empty(n, np.int64)
    at = np.empty(n, np.int64)
    for i in range(-2 * PREFETCH_AHEAD, n):
        if i + 2 * PREFETCH_AHEAD < n:
            prefetch_item(slots, home[i + 2 * PREFETCH_AHEAD])
        j = i + PREFETCH_AHEAD
        if 0 <= j < n:
            s, c = candidate(slots, tags[j], row_mask, home[j])
            at[j] = s
            rows[j] = c
            if c >= 0:
                prefetch_item(row_ids, c)
                if gather:
                    prefetch_row(weights, c)
                    prefetch_item(stamps, c)
        if i < 0:
            continue
        r = rows[i]
        if r >= 0 and row_ids[r] != ids[i]:
            r = probe(slots, row_ids, ids[i], tags[i], row_mask, next_slot(at[i], num_slots))[1]
            rows[i] = r
        if not gather:
            continue
        p = positions[i] if scatter else i
        if r < 0:
            for d in range(dim):
                out[p, d] = 0.0
            continue
        for d in range(dim):
            out[p, d] = as_answered(weights[r, d], out[p, d])
        stamps[r] = tick
    return rows


@njit(cache=True, nogil=True)
def _find_or_insert_kernel(slots: np.ndarray, row_ids: np.ndarray, row_mask: np.uint64,
                           ids: np.ndarray, home: np.ndarray, tags: np.ndarray, start: int,
                           rows: np.ndarray, is_new: np.ndarray, next_row: int, count: int,
                           max_count: int) -> tuple[int, int, int]:
    """Fill ``rows``/``is_new`` from ``start`` on (``home``/``tags``: of ``ids[start:]``);
    a new id gets row ``next_row`` and is written to ``row_ids`` there. Stops before
    exceeding ``max_count``.

    Returns ``(stopped_at, count, next_row)``; ``stopped_at < len(ids)`` means the
    caller must grow the slot array and call again from there.
    """
    n = home.shape[0]
    for j in range(n):
        if j + PREFETCH_AHEAD < n:
            prefetch_item(slots, home[j + PREFETCH_AHEAD])
        i = start + j
        s, r = probe(slots, row_ids, ids[i], tags[j], row_mask, home[j])
        if r >= 0:
            rows[i] = r
            continue
        if count >= max_count:
            return i, count, next_row
        slots[s] = tags[j] | np.uint64(next_row + 1)
        row_ids[next_row] = ids[i]
        rows[i] = next_row
        is_new[i] = True
        next_row += 1
        count += 1
    return ids.shape[0], count, next_row


@njit(cache=True, nogil=True)
def _insert_all_kernel(slots: np.ndarray, row_ids: np.ndarray, row_mask: np.uint64,
                       ids: np.ndarray, home: np.ndarray, tags: np.ndarray,
                       rows: np.ndarray) -> int:
    """Insert ``ids[i] -> rows[i]`` into empty-enough slots, writing ``row_ids``; returns
    the position of a repeated id, or -1."""
    n = ids.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            prefetch_item(slots, home[i + PREFETCH_AHEAD])
        s, r = probe(slots, row_ids, ids[i], tags[i], row_mask, home[i])
        if r >= 0:
            return i
        slots[s] = tags[i] | np.uint64(rows[i] + 1)
        row_ids[rows[i]] = ids[i]
    return -1


_REHASH_CHUNK = 4096
"""Entries a growth moves per round: its temporaries stay in the first-level caches."""


@njit(cache=True, nogil=True)
def _rehash_kernel(old: np.ndarray, old_row_mask: np.uint64, slots: np.ndarray,
                   row_ids: np.ndarray, row_mask: np.uint64, words: np.ndarray,
                   tag_mask: np.uint64, row_bits: int) -> None:
    """Insert every entry of the slot array ``old`` into the empty ``slots`` (a growth:
    the entries are distinct). A chunk of entries at a time, in three passes that each
    prefetch what the next needs: their rows from the old slots (read in order), their
    ids (random reads of ``row_ids``) into homes and tags, then the new slots (random).
    Done entry by entry, each entry waited on its id's miss and then its new slot's.
    The temporaries are chunk-sized, not index-sized: a process keeps its peak heap
    (``persia_py.ops.allocator``), so arrays the size of the index, made at each
    growth, would stay resident for good."""
    num_slots = slots.shape[0]
    rows = np.empty(_REHASH_CHUNK, np.int64)
    home = np.empty(_REHASH_CHUNK, np.int64)
    tags = np.empty(_REHASH_CHUNK, np.uint64)
    i = 0
    while i < old.shape[0]:
        n = 0
        while i < old.shape[0] and n < _REHASH_CHUNK:
            v = np.uint64(old[i])
            i += 1
            if v != 0:
                r = np.int64(v & old_row_mask) - 1
                prefetch_item(row_ids, r)
                rows[n] = r
                n += 1
        for j in range(n):
            home[j], tags[j] = home_and_tag(keyed_hash_one(row_ids[rows[j]], words),
                                            num_slots, tag_mask, row_bits)
            prefetch_item(slots, home[j])
        for j in range(n):
            s = int(home[j])
            while slots[s] != 0:
                s = next_slot(s, num_slots)
            slots[s] = tags[j] | np.uint64(rows[j] + 1)


@njit(cache=True, nogil=True)
def _longest_run(slots: np.ndarray) -> int:
    """Longest run of occupied slots, wrapping around (the slot array is never full)."""
    n = slots.shape[0]
    first_empty = 0
    while slots[first_empty] != 0:
        first_empty += 1
    longest = run = 0
    for step in range(1, n + 1):
        if slots[(first_empty + step) % n] == 0:
            run = 0
        else:
            run += 1
            longest = max(longest, run)
    return longest


_NO_ROWS = np.zeros(0, np.int64)
_NO_WEIGHTS = np.zeros((0, 1), np.float32)
_NO_STAMPS = np.zeros(0, STAMP_DTYPE)


def slots_for(entries: int, minimum: int = MIN_SLOTS) -> int:
    """Smallest slot count (``2**e x k / SIZE_STEPS`` with ``SIZE_STEPS <= k <
    2 x SIZE_STEPS``, whole) >= ``minimum`` (and ``MIN_SLOTS``) that holds ``entries``
    at the load bound."""
    num, den = MAX_LOAD
    need = max(minimum, MIN_SLOTS, -(-entries * den // num))
    # 2**e <= need < 2**(e + 1); counts between are whole multiples of 2**e / SIZE_STEPS.
    step = max((1 << (need.bit_length() - 1)) // SIZE_STEPS, 1)
    return -(-need // step) * step


def slot_dtype(slots: int, row_limit: int = 0) -> np.dtype:
    """The slot type of an index of ``slots`` slots whose rows stay below ``row_limit``:
    uint32 while that leaves ``MIN_TAG_BITS`` tag bits, else uint64."""
    return np.dtype(np.uint32 if _row_bits(slots, row_limit) <= 32 - MIN_TAG_BITS
                    else np.uint64)


def max_entries_of_narrow_slots() -> int:
    """Most rows an index keeps in uint32 slots (more: uint64 slots, twice the bytes)."""
    num, den = MAX_LOAD
    return (1 << (32 - MIN_TAG_BITS)) * num // den


def index_bytes(entries: int) -> int:
    """Bytes of the slot array of an index holding ``entries`` rows ``0..entries-1`` after
    the growths that filled it (the figure :mod:`persia_py.servers.sizing` plans with)."""
    slots = slots_for(entries)
    return slots * slot_dtype(slots).itemsize


def _row_bits(slots: int, row_limit: int) -> int:
    """Bits that hold ``row + 1`` of every row below ``max(row_limit, slots - 1)``."""
    return max(slots - 1, row_limit).bit_length()


def _check_ids(ids: np.ndarray, name: str = "ids") -> np.ndarray:
    if not isinstance(ids, np.ndarray) or ids.dtype != np.uint64 or ids.ndim != 1:
        raise ValueError(f"{name} must be a 1-D numpy array of dtype uint64")
    if ids.size and bool((ids == RESERVED_ID).any()):
        raise ValueError(f"{name} contains the reserved id 2**64-1, which cannot be stored")
    return np.ascontiguousarray(ids)


class HashIndex:
    """uint64 id -> int64 row map; not thread-safe (callers lock).

    ``row_ids`` is the table's row -> id array, which the index reads to compare ids
    and writes for every row it stores; the owner sets :attr:`row_ids` again whenever it
    reallocates that array. Without one, the index keeps its own (standalone use).
    """

    def __init__(self, initial_slots: int = 1024, row_ids: np.ndarray | None = None) -> None:
        if not isinstance(initial_slots, int) or initial_slots < 1:
            raise ValueError(f"initial_slots must be a positive int, got {initial_slots!r}")
        self._owns_row_ids = row_ids is None
        self.row_ids = np.zeros(0, np.uint64) if row_ids is None else row_ids
        self._min_slots = slots_for(0, initial_slots)
        self._reset(self._min_slots, 0)

    def _reset(self, slots: int, row_limit: int) -> None:
        """An empty slot array of ``slots`` for rows below ``row_limit``, under a new key."""
        if slots >= MAX_SLOTS:
            raise ValueError(f"an index of {slots:,} slots is past the {MAX_SLOTS:,} one "
                             f"internal shard can have; raise num_hashmap_internal_shards")
        self._row_limit = max(row_limit, slots - 1)
        row_bits = _row_bits(slots, row_limit)
        dtype = slot_dtype(slots, row_limit)
        self._slots = memory.zeros(slots, dtype)
        self._row_mask = np.uint64((1 << row_bits) - 1)
        self._row_bits = row_bits
        self._tag_mask = np.uint64((1 << (8 * dtype.itemsize - row_bits)) - 1)
        self._key = HashKey.random()  # every new slot array is filled under a new key
        self._count = 0

    def _homes(self, ids: np.ndarray, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        return homes_and_tags(ids, start, self.slots, self._key.words, self._tag_mask,
                               self._row_bits)

    def _ensure_rows(self, row_end: int) -> None:
        """Make room for rows below ``row_end`` in ``row_ids`` (owned) and in the slots."""
        if self._owns_row_ids and self.row_ids.shape[0] < row_end:
            grown = np.zeros(max(row_end, 2 * self.row_ids.shape[0]), np.uint64)
            grown[:self.row_ids.shape[0]] = self.row_ids
            self.row_ids = grown
        if self.row_ids.shape[0] < row_end:
            raise ValueError(f"row {row_end - 1} is past the {self.row_ids.shape[0]} rows "
                             f"of row_ids")
        if row_end > self._row_limit:
            self._grow(self.slots, row_end)

    def __len__(self) -> int:
        return self._count

    @property
    def slots(self) -> int:
        """Number of slots currently allocated (see :func:`slots_for`)."""
        return self._slots.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by the slot array (``row_ids`` belongs to the table)."""
        return self._slots.nbytes

    def probe_bound(self) -> int:
        """Most slots any :meth:`find` reads for one id now: the longest run of occupied
        slots plus the empty slot that ends it. Small (tens) for any input the key was
        not known for; O(slots) to compute, for tests and diagnostics."""
        return _longest_run(self._slots) + 1

    def probe_args(self) -> tuple[np.ndarray, np.ndarray, np.uint64, np.ndarray, np.uint64,
                                  int]:
        """What ``homes_and_tags`` and ``_find_kernel`` take of this index, for kernels
        that probe many indexes in one call (:mod:`persia_py.servers.request_kernels`):
        slots, row_ids, row mask, key words, tag mask, row bits."""
        return (self._slots, self.row_ids, self._row_mask, self._key.words, self._tag_mask,
                self._row_bits)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Row of each id (int64), -1 where the id is absent; duplicates are fine."""
        return self.find_gather(ids, _NO_WEIGHTS, _NO_WEIGHTS, _NO_STAMPS, 0)

    def find_gather(self, ids: np.ndarray, weights: np.ndarray, out: np.ndarray,
                    stamps: np.ndarray, tick: int,
                    positions: np.ndarray | None = None) -> np.ndarray:
        """:meth:`find`, copying each found id's row of ``weights`` to ``out`` (row
        ``positions[i]`` of it for id ``i``, or row ``i``; zeros where absent) and setting
        its ``stamps`` entry to ``tick``; returns the rows."""
        ids = _check_ids(ids)
        home, tags = self._homes(ids)
        return _find_kernel(self._slots, self.row_ids, self._row_mask, ids, home, tags,
                            weights, out, _NO_ROWS if positions is None else positions,
                            stamps, tick)

    def find_or_insert(self, ids: np.ndarray, next_row: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``ids``, inserting the absent ones; returns ``(rows, is_new)``.

        New ids get rows ``next_row, next_row + 1, ...`` in the order of their first
        position in ``ids`` (and are written to ``row_ids`` there); callers pass unique
        ids (a repeat would just get the row of its first occurrence, with ``is_new``
        False).
        """
        ids = _check_ids(ids)
        if next_row < 0:
            raise ValueError(f"next_row must be >= 0, got {next_row}")
        n = ids.shape[0]
        self._ensure_rows(next_row + n)
        rows = np.empty(n, dtype=np.int64)
        is_new = np.zeros(n, dtype=np.bool_)
        start = 0
        num, den = MAX_LOAD
        while True:
            home, tags = self._homes(ids, start)
            start, self._count, next_row = _find_or_insert_kernel(
                self._slots, self.row_ids, self._row_mask, ids, home, tags, start, rows,
                is_new, next_row, self._count, self.slots * num // den)
            if start >= n:
                return rows, is_new
            # One size step (not sizing for the rest of the batch): most of a batch is
            # usually already present, and geometric steps keep rehash cost amortized O(1).
            self._grow(slots_for(self._count + 1, self.slots + 1), self._row_limit)

    def insert(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Add ``ids[i] -> rows[i]`` for ids absent from the index (distinct; ``rows``
        anywhere in ``row_ids``, not only next), growing as needed."""
        ids = _check_ids(ids)
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if rows.shape != ids.shape:
            raise ValueError(f"rows must have shape {ids.shape}, got {rows.shape}")
        if not rows.size:
            return
        self._ensure_rows(int(rows.max()) + 1)
        num, den = MAX_LOAD
        if self._count + rows.shape[0] > self.slots * num // den:
            self._grow(slots_for(self._count + rows.shape[0], self.slots + 1), self._row_limit)
        dup = _insert_all_kernel(self._slots, self.row_ids, self._row_mask, ids,
                                 *self._homes(ids), rows)
        self._count += rows.shape[0] if dup < 0 else dup
        if dup >= 0:
            raise ValueError(f"id {int(ids[dup])} is already in the index")

    def delete(self, ids: np.ndarray) -> int:
        """Remove the ids present (``row_ids`` must still hold their rows' ids), in
        ``O(len(ids))`` (:mod:`persia_py.servers.hash_removal`); returns how many were."""
        ids = _check_ids(ids)
        removed = delete_kernel(self._slots, self.row_ids, self._row_mask, ids,
                                *self._homes(ids), self._key.words, self._tag_mask,
                                self._row_bits)
        self._count -= removed
        return removed

    def repoint(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Give present ``ids`` (at the rows ``row_ids`` still says) rows ``rows`` instead
        (a compaction, before it moves the ids in ``row_ids``)."""
        ids = _check_ids(ids)
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if rows.shape != ids.shape or (rows.size and int(rows.max()) >= self._row_limit):
            raise ValueError(f"rows must have shape {ids.shape} and stay below "
                             f"{self._row_limit}")
        missing = repoint_kernel(self._slots, self.row_ids, self._row_mask, ids,
                                 *self._homes(ids), rows)
        if missing >= 0:
            raise ValueError(f"id {int(ids[missing])} is not in the index")

    def _grow(self, slots: int, row_limit: int) -> None:
        old, old_row_mask, count = self._slots, self._row_mask, self._count
        self._reset(slots, row_limit)
        _rehash_kernel(old, old_row_mask, self._slots, self.row_ids, self._row_mask,
                       self._key.words, self._tag_mask, self._row_bits)
        self._count = count

    def rebuild(self, ids: np.ndarray, rows: np.ndarray, room: int = 0) -> None:
        """Replace the whole content with ``ids[i] -> rows[i]`` (ids must be unique), sized
        for at least ``room`` entries (to keep a shard that refills from growing again)."""
        ids = _check_ids(ids)
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if rows.shape != ids.shape:
            raise ValueError(f"rows must have shape {ids.shape}, got {rows.shape}")
        if rows.size and int(rows.min()) < 0:
            raise ValueError("rows must be >= 0")
        row_end = int(rows.max()) + 1 if rows.size else 0
        self._reset(slots_for(max(ids.shape[0], room), self._min_slots), row_end)
        self._ensure_rows(row_end)
        dup = _insert_all_kernel(self._slots, self.row_ids, self._row_mask, ids,
                                 *self._homes(ids), rows)
        if dup >= 0:
            self._reset(self._min_slots, 0)
            raise ValueError(f"ids must be unique; id {int(ids[dup])} repeats")
        self._count = ids.shape[0]

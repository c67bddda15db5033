"""Last-access stamps of a shard's rows in 2 bytes each, over a 64-bit table clock.

A table's clock counts lookup calls (:class:`persia_py.servers.storage.EmbeddingTable`)
and may run to 2**62 (it is restored from checkpoints). LRU eviction and expiry only
compare a row's last access with the clock of now, so a row need not keep the whole
value: it keeps a uint16 *unit*, ``(tick - base) >> shift``, where ``base`` and
``shift`` are per shard. A unit is ``2**shift`` ticks; ``shift`` is 0 (stamps exact)
until the rows of a shard span more than 2**15 lookups.

A *rebase* (:meth:`AccessClock.rebase`, one numba pass over the shard's rows in use)
moves ``base`` to the start of the oldest row's unit and picks the smallest ``shift``
that puts the clock of now below unit 2**15, leaving 2**15 units of room. It runs when
the clock would pass unit 65535 (so at most once per 2**15 units of lookups), when
imported rows fall outside the range, and after every eviction or expiry pass (which
costs a pass over the rows anyway), so that ``shift`` comes back down once old rows
are gone. Nothing is clamped: every row keeps its place in the LRU order. What is lost:

* order within a unit: rows last touched within the same ``2**shift`` lookups look
  alike to eviction, which then takes any of them;
* exactness of expiry: a row is expired once its whole unit lies before the cutoff,
  so up to ``2**shift - 1`` lookups late, never early;
* when ``shift`` shrinks, a row keeps its old unit's precision, stamped at the last
  tick that unit covers (younger, never older, than it may be).

Checkpoints and increments keep absolute int64 stamps (:meth:`absolute`, the last
tick of the row's unit, which is the exact tick while ``shift`` is 0;
:meth:`relative`): their format is unchanged.
"""

from __future__ import annotations

import numpy as np
from numba import njit

STAMP_DTYPE = np.dtype(np.uint16)
"""Element type of a shard's ``last_access`` array."""
_LIMIT = 2**16 - 1
"""Largest stamp (the clock may reach unit ``_LIMIT`` before a rebase)."""
_ROOM = 2**15
"""After a rebase the clock of now is below this unit: the units above are room."""
_MAX_REFINE = 14
"""Most halvings of the unit in one rebase: keeps the re-stamped rows below _LIMIT."""


@njit(cache=True, nogil=True)
def _restamp(stamps: np.ndarray, oldest: int, coarser: int, finer: int) -> None:
    """Unit ``s`` becomes ``(s - oldest) >> coarser`` (a coarser unit holding it) or, when
    ``finer`` > 0, the last of the ``2**finer`` finer units that make it up."""
    top = (1 << finer) - 1
    for i in range(stamps.shape[0]):
        v = np.int64(stamps[i]) - oldest
        v = (v >> coarser) if finer == 0 else (v << finer) + top
        stamps[i] = min(v, _LIMIT)


class AccessClock:
    """``base`` and ``shift`` of one shard's uint16 stamps; its caller holds the shard's
    lock."""

    def __init__(self) -> None:
        self.base = 0
        """Absolute tick where unit 0 starts."""
        self.shift = 0
        """A unit is ``2**shift`` ticks."""
        self.latest = 0
        """The latest tick stamped or imported: no row was touched after it."""

    def stamp(self, tick: int, stamps: np.ndarray) -> int:
        """``tick`` (absolute) as a stamp, rebasing ``stamps`` (the shard's rows in use)
        first when it would not fit. Ticks before ``base`` (a late caller) stamp 0."""
        self.latest = max(self.latest, tick)
        if (tick - self.base) >> self.shift > _LIMIT:
            self.rebase(self.latest, stamps)  # rows a later tick stamped fit too
        return max(tick - self.base, 0) >> self.shift

    def cutoff(self, tick: int) -> int:
        """``tick`` as a stamp for comparisons ``stamps < cutoff``, true only of rows whose
        whole unit lies before ``tick``: 0 (nothing is older) at or before ``base``,
        ``_LIMIT + 1`` past the newest unit possible."""
        return min(max(tick - self.base, 0) >> self.shift, _LIMIT + 1)

    def absolute(self, stamps: np.ndarray) -> np.ndarray:
        """Stamps as absolute clock values (int64), for checkpoints and increments: the
        last tick of each unit, at most :attr:`latest`."""
        last = ((stamps.astype(np.int64) + 1) << self.shift) - 1 + self.base
        return np.minimum(last, self.latest)

    def relative(self, absolute: np.ndarray, clock: int, stamps: np.ndarray) -> np.ndarray:
        """Absolute int64 values (each <= ``clock``) as stamps, rebasing ``stamps`` (the
        shard's rows in use) first when ``clock`` or the oldest value would not fit."""
        self.latest = max(self.latest, clock)
        oldest = int(absolute.min()) if absolute.shape[0] else None
        if ((clock - self.base) >> self.shift > _LIMIT
                or (oldest is not None and oldest < self.base)):
            self.rebase(clock, stamps, oldest)
        units = (absolute - self.base) >> self.shift
        return np.clip(units, 0, _LIMIT).astype(STAMP_DTYPE)

    def rebase(self, tick: int, stamps: np.ndarray, oldest: int | None = None) -> None:
        """Move ``base`` to the start of the oldest unit in ``stamps`` (or of ``oldest``,
        an absolute tick, when earlier) and pick the finest ``shift`` that puts ``tick``
        below unit ``_ROOM``; re-stamps ``stamps`` in place, keeping their order."""
        if oldest is not None and stamps.shape[0] == 0:
            self._start_at(tick, oldest)
            return
        first = int(stamps.min()) if stamps.shape[0] else max(tick - self.base, 0) >> self.shift
        if oldest is not None and oldest < self.base + (first << self.shift):
            first = (oldest - self.base) >> self.shift  # floors: the unit holding it
        base = self.base + (first << self.shift)
        shift = max(self.shift - _MAX_REFINE, 0)
        while max(tick - base, 0) >> shift >= _ROOM:
            shift += 1
        if stamps.shape[0]:
            _restamp(stamps, first, max(shift - self.shift, 0), max(self.shift - shift, 0))
        self.base, self.shift = base, shift

    def _start_at(self, tick: int, oldest: int) -> None:
        """Units for an empty shard whose oldest row is ``oldest``: its unit ends there,
        so that values exported by a clock of the same unit or a coarser one (each the
        last tick of its unit) come back exactly."""
        shift = 0
        while (tick - oldest + (1 << shift) - 1) >> shift >= _ROOM:
            shift += 1
        self.base, self.shift = oldest - (1 << shift) + 1, shift

"""Last-access stamps of a shard's rows in 4 bytes each, over a 64-bit table clock.

A table's clock counts lookup calls (:class:`persia_py.servers.storage.EmbeddingTable`)
and may run to 2**62 (it is restored from checkpoints). LRU eviction and expiry only
compare a row's last access with the clock of now, so a row need not keep the whole
value: it keeps ``tick - base`` as a uint32, where ``base`` is per shard. When the clock
is about to run past ``base + 2**32 - 1``, :meth:`AccessClock.stamp` moves ``base`` on by
about 2**31 in one vectorized pass over the shard (once per two billion lookups) and rows
last seen before the new base are clamped to it: their age is then known to be at least
2**31 lookups, which decides every eviction the same (they are older than any other row)
and delays only expiry periods longer than that. Checkpoints and increments keep the
absolute int64 stamps (:meth:`absolute`, :meth:`relative`): their format is unchanged.
"""

from __future__ import annotations

import numpy as np

STAMP_DTYPE = np.dtype(np.uint32)
"""Element type of a shard's ``last_access`` array."""
_LIMIT = 2**32 - 1
"""Largest stamp (the clock may reach ``base + _LIMIT`` before a rebase)."""
_REBASE_KEEP = 2**31
"""Lookups of history a rebase keeps exact."""


class AccessClock:
    """The ``base`` of one shard's uint32 stamps; its caller holds the shard's lock."""

    def __init__(self) -> None:
        self.base = 0

    def stamp(self, tick: int, stamps: np.ndarray) -> int:
        """``tick`` (absolute) as a stamp, rebasing ``stamps`` (the shard's rows in use)
        first when it would not fit. Ticks before ``base`` (a late caller) stamp 0."""
        if tick - self.base > _LIMIT:
            self._rebase(tick - _REBASE_KEEP, stamps)
        return max(tick - self.base, 0)

    def cutoff(self, tick: int) -> int:
        """``tick`` as a stamp for comparisons ``stamps < cutoff``: 0 (nothing is older)
        when it is at or before ``base``, the limit past the newest stamp possible."""
        return min(max(tick - self.base, 0), _LIMIT + 1)

    def absolute(self, stamps: np.ndarray) -> np.ndarray:
        """Stamps as absolute clock values (int64), for checkpoints and increments."""
        return stamps.astype(np.int64) + self.base

    def relative(self, absolute: np.ndarray, clock: int, stamps: np.ndarray) -> np.ndarray:
        """Absolute int64 values (each <= ``clock``) as stamps, rebasing ``stamps`` (the
        shard's rows in use) first when ``clock`` would not fit; values before the base
        are clamped to it."""
        if clock - self.base > _LIMIT:
            self._rebase(clock - _REBASE_KEEP, stamps)
        shifted = np.clip(absolute - self.base, 0, _LIMIT)
        return shifted.astype(STAMP_DTYPE)

    def _rebase(self, base: int, stamps: np.ndarray) -> None:
        shift = base - self.base
        if shift > _LIMIT:
            stamps[:] = 0
        else:
            np.maximum(stamps, STAMP_DTYPE.type(shift), out=stamps)
            stamps -= STAMP_DTYPE.type(shift)
        self.base = base

"""``DiskStamps``: the last access of every row on a disk tier, for the tier's TTL.

A row on disk is never touched there (a lookup or update brings it back to RAM first),
so its last access is the one it had when it was spilled; the tier keeps it per slot of
its log (:class:`persia_py.servers.disk_tier.DiskTier`), moves it with the row when
compaction relocates the row, and deletes the rows whose stamp lies before a cutoff of
the table's lookup clock (:mod:`persia_py.servers.lookup_clock`: the disk's own TTL,
``disk_tier.expire_after_steps`` / ``expire_after_seconds``, and a slot's TTL unless
``disk_tier.spill_expired``).

A stamp is a uint32 offset from a per-tier ``base`` tick: 4 bytes per slot (about 4.6
per disk row at the default reserve), and only on tiers with a TTL to keep. Once the
clock runs 2**32 - 1 ticks past ``base``, ``base`` moves up to the oldest stamp (a pass
over the slots); stamps older than the new base by more than 2**31 ticks (rows that any
TTL of under 2**31 steps has deleted long ago) are clamped to it, so such a row could
expire later than it should, never earlier.
"""

from __future__ import annotations

import numpy as np

__all__ = ["DiskStamps"]

_LIMIT = 2**32 - 1
"""Largest stamp offset."""
_ROOM = 2**31
"""After a move of ``base`` the newest tick is at most this far past it."""


class DiskStamps:
    """Last-access ticks of ``num_slots`` log slots; its caller holds the shard's lock."""

    def __init__(self, num_slots: int) -> None:
        self.base = 0
        """Absolute tick of offset 0."""
        self.offsets = np.zeros(num_slots, np.uint32)

    @property
    def nbytes(self) -> int:
        return self.offsets.nbytes

    def set(self, start: int, ticks: np.ndarray) -> None:
        """Stamp slots ``start .. start + len(ticks) - 1`` with absolute ``ticks``."""
        if ticks.shape[0] == 0:
            return
        newest = int(ticks.max())
        if newest - self.base > _LIMIT:
            self._move_base(newest)
        rel = np.clip(ticks.astype(np.int64) - self.base, 0, _LIMIT)
        self.offsets[start:start + ticks.shape[0]] = rel

    def get(self, slots: np.ndarray | slice) -> np.ndarray:
        """Absolute ticks (int64) of ``slots``."""
        return self.offsets[slots].astype(np.int64) + self.base

    def older_than(self, cutoff: int) -> np.ndarray:
        """Mask over every slot: stamped before tick ``cutoff`` (free slots too: the
        caller masks them)."""
        rel = cutoff - self.base
        if rel <= 0:
            return np.zeros(self.offsets.shape[0], np.bool_)
        if rel > _LIMIT:
            return np.ones(self.offsets.shape[0], np.bool_)
        return self.offsets < np.uint32(rel)

    def _move_base(self, newest: int) -> None:
        base = max(newest - _ROOM, self.base)
        shift = base - self.base
        np.subtract(self.offsets, np.minimum(self.offsets, np.uint32(min(shift, _LIMIT))),
                    out=self.offsets)
        self.base = base

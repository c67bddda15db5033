"""``ChangeLog``: the ids a shard changed and removed since its last incremental export.

Tracking starts with :meth:`ChangeLog.start` (a table's ``track_changes``, once an
incremental export or a handover needs it); until then nothing is remembered. Both logs
are bounded: past a few times the rows they could name, repeats are merged away (and
removed ids stored again since are dropped), so their memory follows the shard's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["ChangeLog"]


class ChangeLog:
    """Changed and removed ids of one shard; its caller holds the shard's lock."""

    def __init__(self) -> None:
        self.changed: list[np.ndarray] | None = None
        """Ids inserted or updated since the last :meth:`take` (None: not tracked)."""
        self.num_changed = 0
        self.removed: list[np.ndarray] = []
        """Ids evicted or expired since the last :meth:`take` (kept while tracking)."""
        self.num_removed = 0

    @property
    def tracking(self) -> bool:
        return self.changed is not None

    def start(self) -> None:
        if self.changed is None:
            self.changed = []

    def log_changed(self, ids: np.ndarray, bound: int) -> None:
        """Remember ``ids`` as changed; past ``bound`` ids, repeats are merged away."""
        if self.changed is None:
            return
        self.changed.append(ids.copy())
        self.num_changed += ids.shape[0]
        if self.num_changed > bound:
            merged = np.unique(np.concatenate(self.changed))
            self.changed, self.num_changed = [merged], merged.shape[0]

    def log_removed(self, ids: np.ndarray, bound: int,
                    stored: Callable[[np.ndarray], np.ndarray]) -> None:
        """Remember ``ids`` as removed; past ``bound`` ids, repeats go, and so do ids
        ``stored`` (a mask) again since."""
        if self.changed is None:
            return
        self.removed.append(ids.copy())
        self.num_removed += ids.shape[0]
        if self.num_removed > bound:
            merged = np.unique(np.concatenate(self.removed))
            merged = merged[~stored(merged)]
            self.removed, self.num_removed = [merged], merged.shape[0]

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """``(changed, removed)`` ids since the last call, each distinct; both logs start
        again empty."""
        changed = (np.unique(np.concatenate(self.changed)) if self.changed
                   else np.zeros(0, np.uint64))
        removed = (np.unique(np.concatenate(self.removed)) if self.removed
                   else np.zeros(0, np.uint64))
        self.changed, self.num_changed = [], 0
        self.removed, self.num_removed = [], 0
        return changed, removed


def followed_by(rows: tuple[np.ndarray, ...], more: tuple[np.ndarray, ...]
                ) -> tuple[np.ndarray, ...]:
    """Exported rows (ids, weights, state, last access: one array each) followed by
    ``more`` of the same (a shard's rows in RAM, then those read back from its tier)."""
    return tuple(np.concatenate([a, b]) for a, b in zip(rows, more))

"""Rows a training lookup found, kept for the update of the same ids.

An embedding worker sends a batch's gradients for exactly the ids it looked up, in the
same order, a few batches later. Probing the index for them again hashes every id and
reads its slot, a cache miss each; with the rows the lookup found, the update only
checks that each row still holds its id. Nothing here is trusted: a hint is taken by a
cheap fingerprint of the ids (their count, first, middle and last), and the kernel that uses it
(:func:`persia_py.servers.request_kernels.step_tables`) accepts a row only where it is
below the shard's size and ``row_ids`` there is the id (a row moved by eviction, spilled,
or a fingerprint that matched other ids: that id is probed as without a hint). Every
live id has one row, so a row that holds the id is the row a probe would find.

Kept per internal shard, under its lock; an update takes its hint out. Lookups whose
update never comes (another worker's retry, a dropped batch) are forgotten oldest first.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

MAX_HINTS = 32
"""Lookups a shard remembers at most: more than a pipeline keeps in flight (embedding
staleness plus the embedding worker's forward buffer, for a few workers)."""
MAX_HINT_ROWS = 1 << 18
"""Rows a shard's hints hold at most, whatever the lookups' sizes (1 MiB)."""

Fingerprint = tuple[int, int, int, int]


def fingerprint(ids: np.ndarray) -> Fingerprint | None:
    """What a hint is filed under; None for no ids."""
    n = ids.shape[0]
    return None if n == 0 else (n, int(ids[0]), int(ids[n >> 1]), int(ids[-1]))


class RowHints:
    """A shard's recent training lookups' rows, by fingerprint of their ids."""

    def __init__(self) -> None:
        self._hints: OrderedDict[Fingerprint, np.ndarray] = OrderedDict()
        self._rows = 0
        self.held = 0
        """Rows updates found by a hint (without probing), all told."""

    def remember(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """``rows[i]`` was the row of ``ids[i]`` (-1: none) when the lookup ended; rows
        are below 2**31 (a shard whose index has uint32 slots: the only ones a request's
        kernel serves). Kept as an int32 copy."""
        key = fingerprint(ids)
        if key is None or rows.shape[0] > MAX_HINT_ROWS:
            return
        old = self._hints.pop(key, None)
        if old is not None:
            self._rows -= old.shape[0]
        self._hints[key] = rows.astype(np.int32)
        self._rows += rows.shape[0]
        while len(self._hints) > MAX_HINTS or self._rows > MAX_HINT_ROWS:
            self._rows -= self._hints.popitem(last=False)[1].shape[0]

    def take(self, ids: np.ndarray) -> np.ndarray | None:
        """The rows remembered for ids with the fingerprint of ``ids``, forgotten here;
        None if there are none. Possibly another batch's: check each row."""
        key = fingerprint(ids)
        rows = None if key is None else self._hints.pop(key, None)
        if rows is not None:
            self._rows -= rows.shape[0]
        return rows

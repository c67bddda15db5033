"""Admission of new ids into one internal shard of an ``EmbeddingTable``.

Two policies, both optional (see :class:`persia_py.servers.storage.EmbeddingTable`): a
probability, drawn deterministically per ``(id, seed, step)`` so that a rerun with the
same calls makes the same choices, and a minimum number of sightings, counted per lookup
call in a count-min sketch of one-byte counters (collisions can only make an id count
higher) that is halved now and then so that counts follow recent traffic.
"""

from __future__ import annotations

import numpy as np

from persia_py.ids.hashing import ADMIT_SALT, HashKey, mix64
from persia_py.servers import kernels

_SKETCH_DEPTH = 4
_SKETCH_MIN_WIDTH = 1 << 12
_SKETCH_MAX_WIDTH = 1 << 22
# Halve every counter after this many sightings per sketch column, so that counts
# reflect recent traffic and the sketch never saturates.
_SKETCH_DECAY_PER_COLUMN = 8


_FREQUENCY_COLUMNS = 2
"""Sketch columns per row of the share for the frequency of ids under a disk tier."""
_FREQUENCY_MAX_WIDTH = 1 << 40
"""Not capped as admission's: a 10M-row share needs 2**25 columns for 2 per row."""


def sketch_width(share: int, columns_per_row: int = 1, max_width: int = _SKETCH_MAX_WIDTH
                 ) -> int:
    """Columns of a :class:`CountMinSketch` for ``share`` rows."""
    width = 1 << max(share * columns_per_row - 1, 1).bit_length()
    return min(max(width, _SKETCH_MIN_WIDTH), max_width)


def frequency_sketch(share: int) -> CountMinSketch:
    """The sketch of lookups a shard of ``share`` rows with a disk tier evicts by."""
    return CountMinSketch(share, _FREQUENCY_COLUMNS, _FREQUENCY_MAX_WIDTH)


def frequency_sketch_bytes(share: int) -> int:
    """Bytes of :func:`frequency_sketch` ``(share)`` (what the planner adds per shard)."""
    return _SKETCH_DEPTH * sketch_width(share, _FREQUENCY_COLUMNS, _FREQUENCY_MAX_WIDTH)


class CountMinSketch:
    """Sightings of ids, ``4 x width`` one-byte counters sized for a shard's share:
    ``width`` the power of two at or above ``columns_per_row x share``, at most
    ``max_width``."""

    def __init__(self, share: int, columns_per_row: int = 1,
                 max_width: int = _SKETCH_MAX_WIDTH) -> None:
        width = sketch_width(share, columns_per_row, max_width)
        self.counters = np.zeros((_SKETCH_DEPTH, width), dtype=np.uint8)
        # Secret salts: with public ones, ids could be crafted to share counters and
        # reach ``min_occurrences`` sooner (no slowdown: the sketch never probes).
        self.salts = HashKey.random(_SKETCH_DEPTH).words
        self.sightings = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the counters."""
        return self.counters.nbytes

    def seen_enough(self, ids: np.ndarray, min_occurrences: int) -> np.ndarray:
        """Count one sighting of each of ``ids`` (distinct); which have now been seen
        ``min_occurrences`` times or more (bool mask)."""
        keep = kernels.count_sightings(self.counters, self.salts, ids, min_occurrences)
        self.sightings += ids.shape[0]
        if self.sightings >= _SKETCH_DECAY_PER_COLUMN * self.counters.shape[1]:
            self.counters >>= 1
            self.sightings = 0
        return keep

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        """Sightings of each id as counted (uint8; collisions can only add), halved as
        the sketch ages; counts nothing."""
        return kernels.sketch_estimates(self.counters, self.salts, ids)


class Admission:
    """Which absent ids one shard stores now; its caller holds the shard's lock."""

    def __init__(self, share: int, *, admit_probability: float, min_occurrences: int,
                 seed: int) -> None:
        self.admit_probability = admit_probability
        self.min_occurrences = min_occurrences
        self.seed = seed
        self.sketch = CountMinSketch(share) if min_occurrences > 1 else None
        """Sightings of absent ids (None: every id is admitted at its first sighting)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the sketch (0 without one)."""
        return 0 if self.sketch is None else self.sketch.nbytes

    def admit(self, new_ids: np.ndarray, tick: int) -> np.ndarray:
        """Which of these distinct absent ids may be stored now (bool mask), at lookup
        ``tick`` (the step of the admission draw)."""
        keep = np.ones(new_ids.shape[0], dtype=np.bool_)
        if self.sketch is not None:
            keep = self.sketch.seen_enough(new_ids, self.min_occurrences)
        if self.admit_probability < 1.0:
            draw = mix64(mix64(new_ids, ADMIT_SALT ^ np.uint64(self.seed)), np.uint64(tick))
            unit = (draw >> np.uint64(11)).astype(np.float64) * 2.0**-53
            keep &= unit < self.admit_probability
        return keep

"""Embedding-side user API: batch data types (``data``), optimizers (``optim``) and
:class:`EmbeddingConfig`, the table settings a training job sends to the servers."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class EmbeddingConfig:
    """Table-wide embedding settings, sent with the optimizer (as PERSIA's ``EmbeddingConfig``)."""

    emb_initialization: tuple[float, float] = (-0.01, 0.01)
    """Bounds of the uniform initialization of a new row (a pure function of id and seed)."""
    weight_bound: float | None = None
    """Clamp every weight to [-weight_bound, weight_bound] after each update; None: no clamp."""
    seed: int = 0
    """Seed of the per-id initialization."""

    def __post_init__(self) -> None:
        low, high = self.emb_initialization
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"emb_initialization must be (lower, upper) with lower < upper, "
                             f"got {self.emb_initialization}")
        if self.weight_bound is not None and not self.weight_bound > 0:
            raise ValueError(f"weight_bound must be > 0 or None, got {self.weight_bound}")

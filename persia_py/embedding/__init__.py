"""Embedding-side user API: batch data types (``data``), optimizers (``optim``) and
:class:`EmbeddingConfig`, the table settings a training job sends to the servers."""

from __future__ import annotations

from dataclasses import dataclass

from persia_py.config.checks import WrongType, check_number
from persia_py.config.table_policy import check_init_bounds, check_weight_bound

__all__ = ["EmbeddingConfig"]


@dataclass(kw_only=True, frozen=True)
class EmbeddingConfig:
    """Table-wide embedding settings, sent with the optimizer (as PERSIA's ``EmbeddingConfig``).

    Checked by the same rules as the servers apply (:mod:`persia_py.config.table_policy`).
    """

    emb_initialization: tuple[float, float] = (-0.01, 0.01)
    """Bounds ``(lower, upper)`` of the uniform initialization of a new row (a pure
    function of id and seed); ``lower == upper`` fills new rows with that constant."""
    admit_probability: float = 1.0
    """PERSIA's job-wide admission probability. Here admission is per slot
    (``slots_config.<slot>.admit_probability`` in ``embedding_config.yml``), so only 1.0
    (admit every new id) is accepted; anything else is refused rather than ignored."""
    weight_bound: float | None = None
    """Clamp every weight to [-weight_bound, weight_bound] after each update; None: no
    clamp (PERSIA clamped at 10 by default)."""
    seed: int = 0
    """Seed of the per-id initialization."""

    def __post_init__(self) -> None:
        bounds = self.emb_initialization
        if not isinstance(bounds, (tuple, list)):
            raise WrongType(f"emb_initialization: expected (lower, upper), got {bounds!r}")
        if len(bounds) != 2:
            raise ValueError(f"emb_initialization: expected (lower, upper), got {bounds!r}")
        object.__setattr__(self, "emb_initialization", check_init_bounds(*bounds))
        if self.admit_probability != 1.0:
            raise ValueError(
                f"admit_probability: {self.admit_probability!r} is not supported here; set "
                "slots_config.<slot>.admit_probability in embedding_config.yml (admission is "
                "per slot)")
        object.__setattr__(self, "weight_bound", check_weight_bound(self.weight_bound))
        check_number("seed", self.seed, low=0, high=2**64 - 1, integer=True)

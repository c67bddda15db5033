"""The rules on an embedding table's settings, in one place: initialization bounds,
weight bound, capacity, admission and expiry.

Used by the config file (``slots_config.<slot>``), the user's
:class:`persia_py.embedding.EmbeddingConfig`, the parameter server's ``configure`` and
:class:`persia_py.servers.storage.EmbeddingTable`, so that each value is accepted or
refused alike wherever it enters. Errors are ``ValueError`` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from persia_py.config.checks import check_number

MAX_CAPACITY = 2**62
"""Most rows of one table on one replica."""
MAX_MIN_OCCURRENCES = 255
"""``min_occurrences`` is counted in one-byte sketch counters."""


def check_init_bounds(lower: object, upper: object,
                      name: str = "emb_initialization") -> tuple[float, float]:
    """``(lower, upper)`` of the uniform initialization of new rows as floats: finite,
    ``lower <= upper`` (equal bounds fill every new row with that constant, e.g. zeros)."""
    low = check_number(f"{name}[0]", lower)
    high = check_number(f"{name}[1]", upper)
    if not low <= high:
        raise ValueError(f"{name}: expected (lower, upper) with lower <= upper, got "
                         f"({lower!r}, {upper!r})")
    return float(low), float(high)


def check_weight_bound(value: object) -> float | None:
    """``weight_bound``: None (no clamping) or a finite number > 0."""
    if value is None:
        return None
    return float(check_number("weight_bound", value, low=0.0, low_open=True))


@dataclass(kw_only=True, frozen=True)
class TablePolicy:
    """Capacity, admission and expiry of one table (all checked on construction)."""

    capacity: int | None = None
    """Most rows per replica (None: the global ``capacity``)."""
    admit_probability: float = 1.0
    """In (0, 1]: the chance that a training lookup stores an id the table lacks."""
    min_occurrences: int = 1
    """1 to 255: training lookups that must see a new id before it is stored."""
    expire_after_steps: int | None = None
    """Remove rows unseen for this many lookup calls (None: never)."""
    expire_after_seconds: float | None = None
    """Remove rows unseen for this many seconds (None: never)."""

    def __post_init__(self) -> None:
        if self.capacity is not None:
            check_number("capacity", self.capacity, low=1, high=MAX_CAPACITY, integer=True)
        check_number("admit_probability", self.admit_probability, low=0.0, low_open=True,
                     high=1.0)
        check_number("min_occurrences", self.min_occurrences, low=1,
                     high=MAX_MIN_OCCURRENCES, integer=True)
        if self.expire_after_steps is not None:
            check_number("expire_after_steps", self.expire_after_steps, low=1,
                         high=MAX_CAPACITY, integer=True)
        if self.expire_after_seconds is not None:
            check_number("expire_after_seconds", self.expire_after_seconds, low=0.0,
                         low_open=True, high=math.inf)

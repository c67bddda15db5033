"""The one range check behind every numeric setting: configs, optimizers, table policies.

Messages read ``<field>: <value> is out of range; expected <low> <= <field> <= <high>``,
so a config loader can put the key path in front of them unchanged.
"""

from __future__ import annotations

import math

import numpy as np


def check_number(name: str, value: object, *, low: float = -math.inf, high: float = math.inf,
                 low_open: bool = False, high_open: bool = False,
                 integer: bool = False) -> float | int:
    """``value`` as a float (an int with ``integer``) if it is a finite number in the
    interval, else ``ValueError`` naming ``name``, the value and the interval. Bools are
    not numbers here."""
    kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ValueError(f"{name}: expected {'an int' if integer else 'a number'}, "
                         f"got {value!r}")
    number = int(value) if integer else float(value)
    inside = (math.isfinite(number)
              and (number > low if low_open else number >= low)
              and (number < high if high_open else number <= high))
    if not inside:
        raise ValueError(f"{name}: {value!r} is out of range; expected "
                         f"{_interval(name, low, high, low_open, high_open)}")
    return number


def _interval(name: str, low: float, high: float, low_open: bool, high_open: bool) -> str:
    left = "" if low == -math.inf else f"{low} {'<' if low_open else '<='} "
    right = "" if high == math.inf else f" {'<' if high_open else '<='} {high}"
    text = f"{left}{name}{right}"
    return text if left or right else f"a finite {name}"

"""The checks behind the user's arguments: one range check for every numeric setting
(configs, optimizers, table policies) and one type check for the public API's arguments.

Range messages read ``<field>: <value> is out of range; expected <low> <= <field> <= <high>``,
so a config loader can put the key path in front of them unchanged. Type messages read
``<argument>: expected <what to pass>, got <what was passed>`` (``TypeError``).
"""

from __future__ import annotations

import json
import math
import re

import numpy as np


class WrongType(TypeError, ValueError):
    """A value of the wrong type: a ``TypeError`` to the user, and still a ``ValueError``
    to the config loaders and servers that turn any bad value into their own error."""


def check_number(name: str, value: object, *, low: float = -math.inf, high: float = math.inf,
                 low_open: bool = False, high_open: bool = False,
                 integer: bool = False) -> float | int:
    """``value`` as a float (an int with ``integer``) if it is a finite number in the
    interval, else ``ValueError`` naming ``name``, the value and the interval
    (:class:`WrongType` when it is no number at all). Bools are not numbers here."""
    kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise WrongType(f"{name}: expected {'an int' if integer else 'a number'}, "
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


def check_type(where: str, value: object, types: type | tuple[type, ...], expected: str,
               *, optional: bool = False) -> None:
    """``TypeError`` reading ``<where>: expected <expected>, got <what value is>`` unless
    ``value`` is an instance of ``types`` (or None with ``optional``).

    ``where`` names the argument as the user wrote it (``TrainCtx(model=...)``) and
    ``expected`` says what to pass, so the message alone tells the fix. Bools are not
    ints here (``True`` passed as a count is a mistake, not a 1).
    """
    if value is None and optional:
        return
    wanted = types if isinstance(types, tuple) else (types,)
    bool_as_number = isinstance(value, bool) and bool not in wanted
    if bool_as_number or not isinstance(value, wanted):
        raise TypeError(f"{where}: expected {expected}, got {describe(value)}")


def describe(value: object) -> str:
    """What ``value`` is, for an error message: its type, with the value when short and
    the dtype of an array."""
    kind = type(value)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    if isinstance(value, np.ndarray):
        return f"numpy.ndarray of {value.dtype}"
    text = repr(value)
    if isinstance(value, (str, int, float, bool)) and len(text) <= 40:
        return f"{name} {text}"
    return name


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_OPENS = np.frombuffer(b"[{", dtype=np.uint8)
_CLOSES = np.frombuffer(b"]}", dtype=np.uint8)


def load_json(text: str | bytes, where: str, *, max_bytes: int, max_depth: int) -> object:
    """``text`` parsed as JSON, if it is at most ``max_bytes`` long and nests arrays and
    objects at most ``max_depth`` deep; else ``ValueError`` naming ``where`` and the
    problem. Both are checked before parsing, in one pass over the bytes (the parser
    would recurse once per level, and answer a deep text with a RecursionError)."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    if len(raw) > max_bytes:
        raise ValueError(f"{where}: {len(raw)} bytes of JSON, over the bound of {max_bytes}")
    depth = json_depth(raw)
    if depth > max_depth:
        raise ValueError(f"{where}: JSON nested {depth} deep, deeper than {max_depth}")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from None


def json_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in the JSON text ``raw`` (brackets inside strings
    do not count)."""
    codes = np.frombuffer(_JSON_STRING.sub(b'""', raw), dtype=np.uint8)
    steps = np.isin(codes, _OPENS).astype(np.int64) - np.isin(codes, _CLOSES)
    return int(np.cumsum(steps).max(initial=0))

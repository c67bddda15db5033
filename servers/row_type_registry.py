"""The storage types of embedding rows, by name (``slots_config.<slot>.row_dtype``).

Each type is one :class:`RowType` registered in :data:`ROW_TYPES`: what the table code
asks of a type by name (its numpy element type, how its finiteness is read, the range
narrowing into it must keep, whether lookups may answer it as float16) is looked up
there. How kernels read and write its elements is numba's part, specialized on the
element type (:mod:`persia_py.servers.row_types`: ``kernel_view``, ``widen``,
``narrow``); the config files name the types in ``persia_py.config.RowDtype``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from persia_py.config.registry import Registry
from persia_py.wire.finite import BF16_EXPONENT, F16_EXPONENT

F16_MAX = 65504.0
"""float16's largest finite magnitude, where float16 rows saturate."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowType:
    """One storage type of embedding rows (optimizer state stays float32)."""

    storage: np.dtype
    """The numpy element type rows are kept in (bfloat16: ``uint16``, the upper half of
    the float32 bits)."""
    exponent: int | None
    """The exponent field of a half-precision type's bits, which its finiteness is read
    from (:func:`persia_py.wire.finite.halves_finite`); None: float32 (``np.isfinite``)."""
    largest: float | None
    """The largest magnitude it holds: converting rows with a larger one into it is
    refused, where saturating would change the model without a word. None: float32's."""
    answers_float16: bool
    """Whether lookups may answer its rows as float16 (as stored, or narrowed to nearest),
    where the caller asks for it; bfloat16 rows would lose their range."""


ROW_TYPES: Registry[RowType] = Registry("row_dtype")
"""Name -> storage type. Adding one: register it here, teach the kernels its element
type (:mod:`persia_py.servers.row_types`), and add its name to ``persia_py.config.RowDtype``."""
ROW_TYPES.register("float32", RowType(storage=np.dtype(np.float32), exponent=None,
                                      largest=None, answers_float16=True))
ROW_TYPES.register("float16", RowType(storage=np.dtype(np.float16), exponent=F16_EXPONENT,
                                      largest=F16_MAX, answers_float16=True))
ROW_TYPES.register("bfloat16", RowType(storage=np.dtype(np.uint16), exponent=BF16_EXPONENT,
                                       largest=None, answers_float16=False))

ROW_DTYPES = ROW_TYPES
"""The names a slot may choose (``in``, iteration and ``list`` as before the registry)."""


def check_row_dtype(value: object, name: str = "row_dtype") -> str:
    """``value`` if it names a storage type; ValueError naming ``name`` otherwise."""
    if value not in ROW_TYPES:
        raise ValueError(f"{name}: expected one of {ROW_TYPES.names()}, got {value!r}")
    return str(value)


def row_type(row_dtype: str) -> RowType:
    """The storage type named ``row_dtype``; ValueError naming the registered ones."""
    return ROW_TYPES[row_dtype]


def numpy_dtype(row_dtype: str) -> np.dtype:
    """The numpy element type rows of ``row_dtype`` are kept in (bfloat16: uint16 bits)."""
    return ROW_TYPES[row_dtype].storage


def bytes_per_weight(row_dtype: str) -> int:
    """Bytes of one stored weight: 4 for float32, 2 for float16 and bfloat16."""
    return numpy_dtype(row_dtype).itemsize

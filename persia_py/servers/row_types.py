"""Storage types of embedding rows: float32, float16, bfloat16, and stochastic rounding.

A table's weights are stored in its slot's ``row_dtype``; optimizer state stays float32.
Every optimizer step computes in float32 and writes back rounded to the storage type.
Rounding to nearest would lose every update smaller than half a unit in the last place
(at 1.0, float16 steps by 2**-10 and bfloat16 by 2**-7), so training rows would drift
toward their initial values; **stochastic rounding** rounds up with probability equal to
the fraction dropped, so the stored value is right on average (what FBGEMM does for its
float16 rows). Its random bits are a hash of (table seed, id, column, table clock, the
gradient's and old value's bits): no generator state, so a rerun with the same calls
and a replay of the update log make the same choices.

numba has no float16 on the CPU, and numpy has no bfloat16: kernels see both as
``uint16`` bit patterns (:func:`kernel_view`), and ``fmt`` (``F32``/``F16``/``BF16``)
says how to read them. float16 rows are numpy ``float16`` arrays (they go on the wire as
they are); bfloat16 rows are ``uint16`` arrays of the upper half of the float32 bits.

Overflow: float16 holds magnitudes up to 65504; a step that would pass it saturates
there (never infinity). bfloat16 has float32's range and 8 bits of precision.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from persia_py.hashing import GOLDEN, MIX_M1, mix64_one

ROW_DTYPES = ("float32", "float16", "bfloat16")
"""Names of the storage types a slot may choose (``slots_config.<slot>.row_dtype``)."""
F32, F16, BF16 = 0, 1, 2
"""``fmt`` codes of the kernels, in the order of ``ROW_DTYPES``."""
_NUMPY = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(np.uint16)}
NEAREST = np.uint32(0x8000)
"""The "random" 16 bits that make :func:`round_bits` round to nearest (halves away from
zero): a fraction of one half or more rounds up."""
F16_MAX_BITS = 0x7BFF
"""float16's largest finite magnitude (65504), where float16 rows saturate."""
F16_MAX = 65504.0
_BF16_MAX_BITS = 0x7F7F
_S13, _S16, _S29, _S48 = np.uint32(13), np.uint32(16), np.uint64(29), np.uint64(48)
_TWO_112 = np.float32(2.0**112)
_RAND_UNIT = np.float32(2.0**-16)


def check_row_dtype(value: object, name: str = "row_dtype") -> str:
    """``value`` if it names a storage type; ValueError naming ``name`` otherwise."""
    if value not in ROW_DTYPES:
        raise ValueError(f"{name}: expected one of {list(ROW_DTYPES)}, got {value!r}")
    return str(value)


def numpy_dtype(row_dtype: str) -> np.dtype:
    """The numpy element type rows of ``row_dtype`` are kept in (bfloat16: uint16 bits)."""
    return _NUMPY[check_row_dtype(row_dtype)]


def fmt_of(row_dtype: str) -> int:
    """The kernels' ``fmt`` code of ``row_dtype``."""
    return ROW_DTYPES.index(check_row_dtype(row_dtype))


def bytes_per_weight(row_dtype: str) -> int:
    """Bytes of one stored weight: 4 for float32, 2 for float16 and bfloat16."""
    return numpy_dtype(row_dtype).itemsize


def kernel_view(array: np.ndarray) -> np.ndarray:
    """``array`` as the numba kernels take it: float16 as its uint16 bits (no copy)."""
    return array.view(np.uint16) if array.dtype == np.float16 else array


# -- scalar conversions (numba) -----------------------------------------------------------


@njit(cache=True, nogil=True)
def half_to_float(bits: np.uint16, fmt: int) -> np.float32:
    """The float32 value of float16 (``fmt == F16``) or bfloat16 bits (exact)."""
    b = np.uint32(bits)
    if fmt == F16:
        # Exponent and mantissa moved into float32's places read as 2**-112 times the
        # value, subnormals included; one multiply puts the scale right.
        moved = ((b & np.uint32(0x8000)) << _S16) | ((b & np.uint32(0x7FFF)) << _S13)
        return np.uint32(moved).view(np.float32) * _TWO_112
    return np.uint32(b << _S16).view(np.float32)


@njit(cache=True, nogil=True)
def round_bits(value: np.float32, fmt: int, rand16: np.uint32) -> np.uint16:
    """``value`` as float16 or bfloat16 bits, rounded away from zero when the dropped
    fraction plus ``rand16 / 2**16`` reaches one (uniform ``rand16``: stochastic
    rounding; :data:`NEAREST`: to nearest). Magnitudes past the type's largest finite
    value saturate there."""
    bits = np.float32(value).view(np.uint32)
    sign = (bits >> _S16) & np.uint32(0x8000)
    if fmt == BF16:
        # The low 16 bits are the fraction dropped: adding rand16 carries into the kept
        # half exactly when the fraction plus rand16 / 2**16 reaches one.
        kept = np.uint32(((bits & np.uint32(0x7FFFFFFF)) + rand16) >> _S16)
        if kept > np.uint32(_BF16_MAX_BITS):
            kept = np.uint32(_BF16_MAX_BITS)
        return np.uint16(sign | kept)
    magnitude = abs(np.float32(value))
    if not magnitude < np.float32(65536.0):  # also NaN: never stored as such
        return np.uint16(sign | np.uint32(F16_MAX_BITS))
    exponent = max(np.int32((bits >> np.uint32(23)) & np.uint32(0xFF)) - 127, -14)
    # In units of float16's spacing at this exponent (a power of two: exact), the value
    # is an integer part that float16 keeps and a fraction it drops.
    scale = np.uint32((137 - exponent) << 23).view(np.float32)
    units = magnitude * scale
    whole = np.floor(units)
    up = (units - whole) + np.float32(rand16) * _RAND_UNIT >= np.float32(1.0)
    # (exponent + 14) << 10 plus the integer part is the float16 pattern, for subnormals
    # too, and a carry of the integer part past 2**11 moves into the exponent correctly.
    kept = np.uint32(((exponent + 14) << 10) + np.int32(whole) + np.int32(up))
    if kept > np.uint32(F16_MAX_BITS):
        kept = np.uint32(F16_MAX_BITS)
    return np.uint16(sign | kept)


@njit(cache=True, nogil=True)
def draw16(row_key: np.uint64, column: int, grad: np.float32, old: np.uint16) -> np.uint32:
    """16 random bits for rounding column ``column`` of a row: the row's key mixed with
    the column and the bits of the gradient and of the old value (repeated updates of
    one row within one clock tick draw afresh as long as either differs)."""
    z = row_key + np.uint64(column) * GOLDEN
    z ^= (np.uint64(np.float32(grad).view(np.uint32)) << np.uint64(16)) | np.uint64(old)
    z = (z ^ (z >> _S29)) * MIX_M1
    z = (z ^ (z >> _S29)) * MIX_M1
    return np.uint32(z >> _S48)


# -- per-element access, specialized on the array's element type ---------------------------


def load_weight(weights, r, d, fmt):  # pragma: no cover - replaced by the overload in numba
    """``weights[r, d]`` as float32 (numba only)."""
    raise NotImplementedError


@overload(load_weight)
def _load_weight(weights, r, d, fmt):
    if weights.dtype == types.float32:
        return lambda weights, r, d, fmt: weights[r, d]
    return lambda weights, r, d, fmt: half_to_float(weights[r, d], fmt)


def store_weight(weights, r, d, value, fmt, row_key, grad, stochastic):  # pragma: no cover
    """``weights[r, d] = value``, rounded to the stored type (numba only)."""
    raise NotImplementedError


@overload(store_weight)
def _store_weight(weights, r, d, value, fmt, row_key, grad, stochastic):
    if weights.dtype == types.float32:
        def store_float(weights, r, d, value, fmt, row_key, grad, stochastic):
            weights[r, d] = value
        return store_float

    def store_half(weights, r, d, value, fmt, row_key, grad, stochastic):
        rand = draw16(row_key, d, grad, weights[r, d]) if stochastic else NEAREST
        weights[r, d] = round_bits(value, fmt, rand)
    return store_half


def row_key(weights, row_ids, r, tick, sr_key):  # pragma: no cover
    """The rounding key of row ``r`` (numba only; 0 for float32 rows, which never round)."""
    raise NotImplementedError


@overload(row_key)
def _row_key(weights, row_ids, r, tick, sr_key):
    if weights.dtype == types.float32:
        return lambda weights, row_ids, r, tick, sr_key: np.uint64(0)
    return lambda weights, row_ids, r, tick, sr_key: mix64_one(
        row_ids[r] ^ sr_key ^ (np.uint64(tick) * MIX_M1))


def copy_value(out, p, weights, r, d, fmt):  # pragma: no cover
    """``out[p, d] = weights[r, d]``: bits as they are when both have one element type,
    else converted to float32 (numba only)."""
    raise NotImplementedError


@overload(copy_value)
def _copy_value(out, p, weights, r, d, fmt):
    if out.dtype == weights.dtype:
        def copy_bits(out, p, weights, r, d, fmt):
            out[p, d] = weights[r, d]
        return copy_bits

    def copy_float(out, p, weights, r, d, fmt):
        out[p, d] = load_weight(weights, r, d, fmt)
    return copy_float


# -- whole arrays ---------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _encode(values: np.ndarray, fmt: int, out: np.ndarray) -> None:
    for i in range(values.shape[0]):
        for d in range(values.shape[1]):
            out[i, d] = round_bits(values[i, d], fmt, NEAREST)


@njit(cache=True, nogil=True)
def _decode(bits: np.ndarray, fmt: int, out: np.ndarray) -> None:
    for i in range(bits.shape[0]):
        for d in range(bits.shape[1]):
            out[i, d] = half_to_float(bits[i, d], fmt)


def to_stored(values: np.ndarray, row_dtype: str, out: np.ndarray | None = None
              ) -> np.ndarray:
    """float32 rows ``values`` ``(n, dim)`` in ``row_dtype``, rounded to nearest (into
    ``out`` if given); float16 saturates at +-65504."""
    dtype = numpy_dtype(row_dtype)
    values = np.ascontiguousarray(values, dtype=np.float32)
    if out is None:
        out = np.empty(values.shape, dtype)
    if row_dtype == "float32":
        out[...] = values
    else:
        _encode(values, fmt_of(row_dtype), kernel_view(out))
    return out


def to_float32(rows: np.ndarray, row_dtype: str) -> np.ndarray:
    """Stored rows ``(n, dim)`` of ``row_dtype`` as float32 (exact; a new array unless
    they are float32 already)."""
    if row_dtype == "float32":
        return rows
    out = np.empty(rows.shape, np.float32)
    _decode(kernel_view(np.ascontiguousarray(rows)), fmt_of(row_dtype), out)
    return out


def all_finite(rows: np.ndarray, row_dtype: str) -> bool:
    """Whether no stored value is infinite or NaN."""
    if row_dtype == "bfloat16":
        return not bool(((rows & np.uint16(0x7F80)) == np.uint16(0x7F80)).any())
    return bool(np.isfinite(rows).all())


def convert(rows: np.ndarray, source: str, target: str) -> np.ndarray:
    """Rows stored as ``source`` in ``target``'s storage (``rows`` itself when the types
    agree; to nearest when narrowing). ValueError if a value passes float16's range:
    saturating would change the model without a word."""
    if source == target:
        return rows
    values = to_float32(rows, source)
    if target == "float16" and values.size:
        largest = float(np.abs(values).max())
        if largest > F16_MAX:
            raise ValueError(f"weights: the largest magnitude {largest:g} is past float16's "
                             f"{F16_MAX:g}; keep this table in float32 or bfloat16")
    return to_stored(values, target)

"""Storage types of embedding rows: float32, float16, bfloat16, and stochastic rounding.

A table's weights are stored in its slot's ``row_dtype``; optimizer state stays float32.
Every optimizer step computes in float32 and writes back rounded to the storage type.
Rounding to nearest would lose every update smaller than half a unit in the last place
(at 1.0, float16 steps by 2**-10 and bfloat16 by 2**-7), so rows with small updates would
stop learning; **stochastic rounding** rounds away from zero with probability equal to
the fraction dropped (to the draw's resolution: 2**-13 of a unit for float16, 2**-16 for
bfloat16), so the stored value is right on average (what FBGEMM does for its
float16 rows). Its random bits are a hash of (table seed, id, column, the row's optimizer
state after the step, the gradient's bits; SGD, which keeps no state: the table's step
instead): no generator state, so a rerun with the same calls and a replay of the update
log make the same choices. The draw does not depend on the value it rounds, so the
rounding stays unbiased, and an update draws afresh whenever the row's state (or the
step) or its gradient differs from the update before.

numba has no float16 on the CPU, and numpy has no bfloat16: kernels see float16 rows as
``int16`` bit patterns and bfloat16 rows as ``uint16`` ones (:func:`kernel_view`), so
the element type says how to read them. float16 rows are numpy ``float16`` arrays (they
go on the wire as they are); bfloat16 rows are ``uint16`` arrays of the upper half of
the float32 bits.

Overflow: float16 holds magnitudes up to 65504; a step that would pass it saturates
there (never infinity). bfloat16 has float32's range and 8 bits of precision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import overload

from persia_py.ids.hashing import MIX_M1, MIX_M2
from persia_py.ops.f16 import f16_bits, f16_value, fma32, llvm_f32, numba_intrinsic

# The registry of storage types by name; re-exported for the code that converts rows.
from persia_py.servers.row_type_registry import (  # noqa: F401 - re-exported
    F16_MAX,
    ROW_DTYPES,
    ROW_TYPES,
    RowType,
    bytes_per_weight,
    check_row_dtype,
    numpy_dtype,
    row_type,
)
from persia_py.wire.finite import halves_finite

NEAREST = np.uint32(0x8000)
"""The "random" 16 bits that make :func:`round_bits` round to nearest (halves away from
zero): a fraction of one half or more rounds up."""
F16_MAX_BITS = 0x7BFF
"""The bits of :data:`F16_MAX`, float16's largest finite magnitude."""
_BF16_MAX_BITS = np.uint32(0x7F7F)
_S16 = np.uint32(16)
_GOLDEN32, _MIX32_1 = np.uint32(0x9E3779B9), np.uint32(0x85EBCA6B)
_MAGNITUDE, _SIGN = np.uint32(0x7FFFFFFF), np.uint32(0x80000000)
_BF16_SIGN = np.uint32(0x8000)
_EXPONENT_BITS, _F16_NORMAL_BASE = np.uint32(0x7F800000), np.uint32(0x38800000)
"""float32's exponent field, and the bits of 2**-14 (float16's least normal value)."""
_INV_ULP_LESS_BASE, _ULP_BELOW_BASE = np.uint32((254 + 10) << 23), np.uint32(10 << 23)
"""For a power of two ``base`` (its float32 bits ``B``): ``_INV_ULP_LESS_BASE - B`` are
the bits of ``2**10 / base`` and ``B - _ULP_BELOW_BASE`` those of ``base * 2**-10``."""
_NEAREST_HIGH = np.uint32(0x80000000)
_ALL_BITS, _NO_BITS = np.uint32(0xFFFFFFFF), np.uint32(0)


def kernel_view(array: np.ndarray) -> np.ndarray:
    """``array`` as the numba kernels take it (no copy): float16 as ``int16`` bits,
    bfloat16 (``uint16`` bits) and float32 as they are. The element type alone then
    picks the conversion, when numba compiles: no per-value branch on the format."""
    return array.view(np.int16) if array.dtype == np.float16 else array


# -- scalar conversions (numba) -----------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def f16_to_float(bits: np.int16) -> np.float32:
    """The float32 value of float16 bits (exact)."""
    return f16_value(bits)


@njit(cache=True, nogil=True, inline="always")
def bf16_to_float(bits: np.uint16) -> np.float32:
    """The float32 value of bfloat16 bits (exact: its upper half)."""
    return np.uint32(np.uint32(bits) << _S16).view(np.float32)


def _u32_op(name: str, build: Callable[[ir.IRBuilder, ir.Value, ir.Value], ir.Value]
            ) -> Callable[..., Any]:
    """A numba intrinsic ``name(a, b)`` of two uint32 values giving uint32, built by
    ``build(builder, a, b)``. numba widens integer arithmetic to 64 bits, so the rounding's
    hashing and bit twiddling, written as numba operators, vectorize in 64-bit lanes: half
    the lanes, and a 64-bit multiply AVX-512 emulates. In 32-bit lanes they cost the
    update loop next to nothing (docs/benchmarks.md, "float16 rows")."""
    def typer(typingctx, a, b):
        if a != types.uint32 or b != types.uint32:
            return None  # a typing error: pass np.uint32 values
        def codegen(context, builder, signature, args):
            return build(builder, args[0], args[1])
        return types.uint32(types.uint32, types.uint32), codegen
    typer.__name__ = typer.__qualname__ = name
    return numba_intrinsic(typer)


def _select_typer(typingctx, condition, if_true, if_false):
    if condition != types.boolean or if_true != types.uint32 or if_false != types.uint32:
        return None
    def codegen(context, builder, signature, args):
        return builder.select(*args)
    return types.uint32(types.boolean, types.uint32, types.uint32), codegen


_select_typer.__name__ = _select_typer.__qualname__ = "_pick32"
_pick32 = numba_intrinsic(_select_typer)
"""``_pick32(condition, if_true, if_false)``: ``if_true if condition else if_false`` for
uint32 values, as one select: numba lowers a conditional expression to branches, which
the vectorizer must undo (and numba's inliner warns about)."""


_add32 = _u32_op("_add32", lambda b, x, y: b.add(x, y))
_sub32 = _u32_op("_sub32", lambda b, x, y: b.sub(x, y))
_mul32 = _u32_op("_mul32", lambda b, x, y: b.mul(x, y))
_and32 = _u32_op("_and32", lambda b, x, y: b.and_(x, y))
_or32 = _u32_op("_or32", lambda b, x, y: b.or_(x, y))
_xor32 = _u32_op("_xor32", lambda b, x, y: b.xor(x, y))
_shl32 = _u32_op("_shl32", lambda b, x, y: b.shl(x, y))
_shr32 = _u32_op("_shr32", lambda b, x, y: b.lshr(x, y))
_min32 = _u32_op("_min32", lambda b, x, y: b.select(b.icmp_unsigned("<", x, y), x, y))
_max32 = _u32_op("_max32", lambda b, x, y: b.select(b.icmp_unsigned(">", x, y), x, y))


@njit(cache=True, nogil=True, inline="always")
def float_to_bf16(value: np.float32, rand16: np.uint32) -> np.uint16:
    """``value`` as bfloat16 bits, rounded away from zero when the dropped fraction plus
    ``rand16 / 2**16`` reaches one (uniform ``rand16``: stochastic rounding;
    :data:`NEAREST`: to nearest). Past the largest finite value: saturated there."""
    bits = np.float32(value).view(np.uint32)
    sign = _and32(_shr32(bits, _S16), _BF16_SIGN)
    # The low 16 bits are the fraction dropped: adding rand16 carries into the kept half
    # exactly when the fraction plus rand16 / 2**16 reaches one.
    kept = _shr32(_add32(_and32(bits, _MAGNITUDE), np.uint32(rand16)), _S16)
    return np.uint16(_or32(sign, _min32(kept, _BF16_MAX_BITS)))


@numba_intrinsic
def _floor32(typingctx, x):
    """The largest integer not above ``x``, in float32 (one instruction, which numba's
    ``math.floor`` is not: it answers an integer)."""
    def codegen(context, builder, signature, args):
        return llvm_f32(builder, "llvm.floor.f32", *args)
    return types.float32(types.float32), codegen


@numba_intrinsic
def _below32(typingctx, x, bound):
    """``x if x < bound else bound`` for float32 values, as one select (x86's ``minps``:
    NaN gives ``bound``); numba would lower the conditional expression to branches."""
    def codegen(context, builder, signature, args):
        return builder.select(builder.fcmp_ordered("<", args[0], args[1]), args[0], args[1])
    return types.float32(types.float32, types.float32), codegen


@numba_intrinsic
def _draw_fraction(typingctx, rand_high, scale):
    """The top 13 bits of ``rand_high`` as a fraction in ``[0, 1)``: ``(rand_high >> 19) *
    scale`` in float32 (exact), ``scale`` being 2**-13."""
    def codegen(context, builder, signature, args):
        top = builder.lshr(args[0], ir.Constant(ir.IntType(32), 19))
        return builder.fmul(builder.sitofp(top, ir.FloatType()), args[1])
    return types.float32(types.uint32, types.float32), codegen


@numba_intrinsic
def _opaque32(typingctx, value):
    """``value`` (uint32) through an empty inline asm, so LLVM cannot fold it back into a
    constant (see :data:`_F16_CONSTANTS`)."""
    if value != types.uint32:
        return None
    def codegen(context, builder, signature, args):
        # "r", a general register: a constraint every target LLVM compiles for knows.
        i32 = ir.IntType(32)
        return builder.asm(ir.FunctionType(i32, [i32]), "", "=r,0", [args[0]], False)
    return types.uint32(types.uint32), codegen


_F16_CONSTANTS = (_EXPONENT_BITS, _F16_NORMAL_BASE, _INV_ULP_LESS_BASE, _ULP_BELOW_BASE,
                  _MAGNITUDE, _SIGN, np.float32(F16_MAX).view(np.uint32),
                  np.float32(2.0**-13).view(np.uint32), _MIX32_1, _NEAREST_HIGH)
"""The constants of float16 rounding, as uint32 bits (the last: the draw to round to
nearest). numba JIT-compiles with LLVM's large
code model, where a vector loop reaches each constant through a 10-byte ``movabs`` of its
address, per use and iteration: ten of them in the float16 update loops, a few percent of
their time at 4M rows (docs/benchmarks.md, "Parameter server"). The kernels pass them as
values LLVM cannot fold (:func:`rounding_args`), which it keeps in registers (or on the
stack) instead; :func:`float_to_f16` alone uses them as constants."""


@njit(cache=True, nogil=True, inline="always")
def _f16_round(value: np.float32, rand_high: np.uint32, k: tuple) -> np.int16:
    """:func:`float_to_f16` with its random bits in the top of ``rand_high``, where the
    kernels' draw leaves them (the lower bits are ignored); ``k``: :data:`_F16_CONSTANTS`.

    One formula for every range, in float32 arithmetic, no case apart: ``|value|``
    counted in float16 steps (``ulp``: 2**-10 of its binade, at least 2**-24, float16's
    least step) plus the draw as a fraction ``r`` of 13 bits, floored: ``kept =
    floor(|value| / ulp + r) * ulp``. ``1 / ulp`` and ``ulp`` are powers of two made from
    the exponent's bits, so the product is exact, and for ``|value| >= 2**-24`` so is the
    floor of the sum (an fma): below the next integer the sum has at most 24 significant
    bits on a grid of 2**-13 or finer, and rounding never carries it past one. Below
    2**-24 the sum is rounded once, as the rule says. The CPU then converts ``kept``,
    which float16 holds, exactly: 14 vector operations per 16 values from the draw's bits
    to the conversion, where shifting bit fields took 17 (docs/benchmarks.md, "Parameter
    server")."""
    bits = np.float32(value).view(np.uint32)
    base = _max32(_and32(bits, k[0]), k[1])
    inv_ulp = np.uint32(_sub32(k[2], base)).view(np.float32)
    ulp = np.uint32(_sub32(base, k[3])).view(np.float32)
    magnitude = np.uint32(_and32(bits, k[4])).view(np.float32)
    draw: np.float32 = _draw_fraction(np.uint32(rand_high), np.uint32(k[7]).view(np.float32))
    quanta = _floor32(fma32(magnitude, inv_ulp, draw))
    kept: np.float32 = _below32(quanta * ulp, np.uint32(k[6]).view(np.float32))  # NaN saturates too
    return f16_bits(np.uint32(_or32(_and32(bits, k[5]), np.float32(kept).view(np.uint32))).view(np.float32))


@njit(cache=True, nogil=True, inline="always")
def float_to_f16(value: np.float32, rand16: np.uint32) -> np.int16:
    """``value`` as float16 bits, rounded as :func:`float_to_bf16` says but with the top 13
    bits of ``rand16`` (``(rand16 >> 3) / 2**13``): every float32 value of float16's normal
    range drops 13 fraction bits, so there the rule is the same; below it (2**-14) the
    draw's resolution is ``2**-13`` of a unit where it could be finer, and below 2**-24
    the sum is rounded once in float32. Magnitudes past 65504 (and NaN) saturate there.
    No branch: a loop of these vectorizes."""
    return _f16_round(value, _shl32(np.uint32(rand16), _S16), _F16_CONSTANTS)


@njit(cache=True, nogil=True, inline="always")
def next_column_key(key: np.uint32) -> np.uint32:
    """The rounding key of the next column: column ``d`` of a row is keyed by
    ``row_key + d * 0x9E3779B9`` (mod 2**32). The kernels step it column by column: a
    running sum vectorizes to one add per vector, the product with ``d`` to two."""
    return _add32(np.uint32(key), _GOLDEN32)


@njit(cache=True, nogil=True, inline="always")
def draw32(key: np.uint32, grad: np.float32) -> np.uint32:
    """32 bits whose top 16 are random, for rounding one column of a row: the column's
    ``key`` (:func:`next_column_key`) mixed with the bits of the gradient. One 32-bit
    multiply, which vectorizes: its top bits depend on every bit below them, and the
    row's key is a full 64-bit mix already."""
    return _mul32(_xor32(np.uint32(key), np.float32(grad).view(np.uint32)), _MIX32_1)


@njit(cache=True, nogil=True, inline="always")
def _draw32_by(key: np.uint32, grad: np.float32, multiplier: np.uint32) -> np.uint32:
    """:func:`draw32` with its multiplier passed (``_MIX32_1``)."""
    return _mul32(_xor32(np.uint32(key), np.float32(grad).view(np.uint32)), multiplier)


# -- per-element access, specialized on the stored element type -----------------------------
# Scalars only: a numba function that takes an array is called with the array's whole
# descriptor, which per element cost more than the conversion itself.


def widen(stored):  # pragma: no cover - replaced by the overload in numba
    """A stored weight as float32 (numba only)."""
    raise NotImplementedError


@overload(widen, inline="always")
def _widen(stored):
    if stored == types.float32:
        return lambda stored: stored
    if stored == types.int16:
        return lambda stored: f16_to_float(stored)
    return lambda stored: bf16_to_float(stored)


def rounding_args(weights, stochastic):  # pragma: no cover
    """What :func:`narrow` takes as ``stochastic`` in a kernel stepping ``weights`` (numba
    only): ``stochastic`` itself, or for float16 rows ``(keep, constants)``: the rounding's
    constants as values LLVM cannot fold (:data:`_F16_CONSTANTS`), the last one the bits
    that replace the draw (0, or :data:`_NEAREST_HIGH` to round to nearest), and ``keep``
    the mask of the draw's bits kept (all, or none). ``draw & keep | fixed`` is one vector
    operation where a select on ``stochastic`` was a test and a branch per vector, which
    LLVM did not hoist. Made once per kernel call, before its loops."""
    raise NotImplementedError


@overload(rounding_args, inline="always")
def _rounding_args(weights, stochastic):
    if weights.dtype != types.int16:
        return lambda weights, stochastic: stochastic

    def f16_args(weights, stochastic):
        k = _F16_CONSTANTS
        keep = _pick32(stochastic, _ALL_BITS, _NO_BITS)
        fixed = _pick32(stochastic, _NO_BITS, k[9])
        return (_opaque32(keep), (_opaque32(k[0]), _opaque32(k[1]), _opaque32(k[2]),
                                  _opaque32(k[3]), _opaque32(k[4]), _opaque32(k[5]),
                                  _opaque32(k[6]), _opaque32(k[7]), _opaque32(k[8]),
                                  _opaque32(fixed)))
    return f16_args


def narrow(value, old, key, grad, stochastic):  # pragma: no cover
    """float32 ``value`` in the type of the stored ``old`` it replaces (numba only):
    rounded stochastically with bits drawn from the column's ``key``
    (:func:`next_column_key`) and ``grad`` (``stochastic``), else to nearest.
    ``stochastic``: a bool, or what :func:`rounding_args` made of it."""
    raise NotImplementedError


@overload(narrow, inline="always")
def _narrow(value, old, key, grad, stochastic):
    if old == types.float32:
        return lambda value, old, key, grad, stochastic: value
    if old == types.int16 and isinstance(stochastic, types.BaseTuple):
        def round_f16_args(value, old, key, grad, stochastic):
            keep, k = stochastic
            draw = _draw32_by(key, grad, k[8])
            return _f16_round(value, _or32(_and32(draw, keep), k[9]), k)  # k[9]: 0 or nearest
        return round_f16_args
    if old == types.int16:
        def round_f16(value, old, key, grad, stochastic):
            draw = draw32(key, grad)
            return _f16_round(value, _pick32(stochastic, draw, _NEAREST_HIGH), _F16_CONSTANTS)
        return round_f16

    def round_bf16(value, old, key, grad, stochastic):
        draw = draw32(key, grad)
        return float_to_bf16(value, _shr32(_pick32(stochastic, draw, _NEAREST_HIGH), _S16))
    return round_bf16


def as_answered(stored, like):  # pragma: no cover
    """A stored weight in the element type of ``like`` (numba only): its bits when the
    types match, half-precision rows widened to float32, float32 rows narrowed to float16
    bits to nearest even (infinity past 65504), as numpy's and torch's casts do."""
    raise NotImplementedError


@overload(as_answered, inline="always")
def _as_answered(stored, like):
    if stored == like:
        return lambda stored, like: stored
    if like == types.float32:
        return lambda stored, like: widen(stored)
    if stored == types.float32 and like == types.int16:
        return lambda stored, like: f16_bits(stored)
    return None  # a typing error: no such answer


@numba_intrinsic
def _fold_mix32(typingctx, value):
    """The top 32 bits of ``hi ^ lo``, the halves of the 128-bit product ``value *
    MIX_M2``: every bit of ``value`` reaches them (through the high half's carries), in
    one multiply where :func:`mix64_one` takes two and a chain of shifts, which cost the
    float16 updates about as much as their rounding (docs/benchmarks.md, "Parameter
    server"). Its draws on sequential ids and a slowly moving state are as uniform and as
    uncorrelated as those of ``mix64_one`` (tests/test_row_types.py)."""
    if value != types.uint64:
        return None
    def codegen(context, builder, signature, args):
        i64, i128 = ir.IntType(64), ir.IntType(128)
        product = builder.mul(builder.zext(args[0], i128), ir.Constant(i128, int(MIX_M2)))
        high = builder.trunc(builder.lshr(product, ir.Constant(i128, 64)), i64)
        folded = builder.xor(high, builder.trunc(product, i64))
        return builder.trunc(builder.lshr(folded, ir.Constant(i64, 32)), ir.IntType(32))
    return types.uint32(types.uint64), codegen


def row_key(stored, row_id, salt, sr_key):  # pragma: no cover
    """The rounding key of a row whose weights are of the type of ``stored``, with id
    ``row_id``, after an update that ``salt`` stands for (numba only; 0 for float32 rows,
    which never round): ``row_id ^ sr_key ^ salt * MIX_M1`` mixed by :func:`_fold_mix32`."""
    raise NotImplementedError


@overload(row_key, inline="always")
def _row_key(stored, row_id, salt, sr_key):
    if stored == types.float32:
        return lambda stored, row_id, salt, sr_key: np.uint32(0)

    def key(stored, row_id, salt, sr_key):
        return _fold_mix32(row_id ^ sr_key ^ (np.uint64(salt) * MIX_M1))
    return key


# -- whole arrays ---------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _encode(values: np.ndarray, out: np.ndarray) -> None:
    for i in range(values.shape[0]):
        for d in range(values.shape[1]):
            out[i, d] = narrow(values[i, d], out[i, d], np.uint32(0), np.float32(0.0), False)


@njit(cache=True, nogil=True)
def _decode(bits: np.ndarray, out: np.ndarray) -> None:
    for i in range(bits.shape[0]):
        for d in range(bits.shape[1]):
            out[i, d] = widen(bits[i, d])


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
        _encode(values, kernel_view(out))
    return out


def to_float32(rows: np.ndarray, row_dtype: str) -> np.ndarray:
    """Stored rows ``(n, dim)`` of ``row_dtype`` as float32 (exact; a new array unless
    they are float32 already)."""
    if row_dtype == "float32":
        return rows
    out = np.empty(rows.shape, np.float32)
    _decode(kernel_view(np.ascontiguousarray(rows)), out)
    return out


def all_finite(rows: np.ndarray, row_dtype: str) -> bool:
    """Whether no stored value is infinite or NaN (half-precision rows by their exponent
    bits, in one pass: numpy's ``isfinite`` of float16 converts value by value)."""
    exponent = row_type(row_dtype).exponent
    if exponent is None:
        return bool(np.isfinite(rows).all())
    return halves_finite(rows, exponent)


def convert(rows: np.ndarray, source: str, target: str) -> np.ndarray:
    """Rows stored as ``source`` in ``target``'s storage (``rows`` itself when the types
    agree; to nearest when narrowing). ValueError if a value passes float16's range:
    saturating would change the model without a word."""
    if source == target:
        return rows
    values = to_float32(rows, source)
    bound = row_type(target).largest
    if bound is not None and values.size:
        largest = float(np.abs(values).max())
        if largest > bound:
            wide = " or ".join(n for n, t in ROW_TYPES.items() if t.largest is None)
            raise ValueError(f"weights: the largest magnitude {largest:g} is past {target}'s "
                             f"{bound:g}; keep this table in {wide}")
    return to_stored(values, target)

"""Fused numba kernels of the parameter-server storage: gather, optimizer steps, init.

Every kernel walks a batch once and works on each id's row in place, so no batch-sized
copy of weights or optimizer state is ever made. Rows are random in memory; each
kernel prefetches the rows ``PREFETCH_AHEAD`` ids ahead, so the cache misses of consecutive
ids overlap instead of queueing one behind another (which makes a row-by-row gather faster
than ``numpy.take``: docs/benchmarks.md).

All arithmetic is float32 with float32 constants (the caller converts them), matching
the numpy formulas of :mod:`persia_py.servers.optimizers` operation for operation.
Weights may be stored as float16 or bfloat16 bits (:mod:`persia_py.servers.row_types`):
a step reads each weight as float32 (``widen``) and writes it back rounded (``narrow``),
element by element in one vectorized loop, with no float32 copy of the row; numba
specializes both on the element type, so for float32 rows they compile to nothing.
Stochastic rounding keys a row's draws by its optimizer state after the step, so the
adaptive steps update the state in a first pass over the row and the weights in a
second.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import overload

from persia_py.ids.dedup import rows_in_order
from persia_py.ids.hashing import mix64_one
from persia_py.ops.f16 import numba_intrinsic
from persia_py.servers.row_types import (
    as_answered,
    narrow,
    next_column_key,
    rounding_args,
    row_key,
    widen,
)

PREFETCH_AHEAD = 16
"""Ids between a prefetch and the use of its row: far enough for the miss to resolve,
near enough that the line is still cached. The best distance depends on the machine
(how many misses a core keeps in flight, how long each takes): 8 did best on an older
VM, 16-24 on a newer one; 16 is within the best range of both (docs/benchmarks.md,
"Parameter server")."""
_LINE_BYTES = 64
_S40 = np.uint64(40)
_GOLDEN64 = np.uint64(0x9E3779B97F4A7C15)
"""Fibonacci hashing's multiplier: spreads consecutive row numbers over a set's slots."""


def _prefetch_codegen(context, builder, signature, args):
    """Prefetch the cache line of ``array[indices]`` (for writing: we write most rows)."""
    array_type = signature.args[0]
    array_struct = context.make_array(array_type)(context, builder, args[0])
    pointer = cgutils.get_item_pointer(context, builder, array_type, array_struct,
                                       list(args[1:]), wraparound=False)
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
    # (address, rw=1 write, locality=3 keep in all levels, cache type=1 data)
    builder.call(fn, [builder.bitcast(pointer, i8p), i32(1), i32(3), i32(1)])
    return context.get_dummy_value()


@numba_intrinsic
def _prefetch1(typingctx, array, index):
    return types.void(array, index), _prefetch_codegen


@numba_intrinsic
def _prefetch2(typingctx, array, row, col):
    return types.void(array, row, col), _prefetch_codegen


def _per_line(array):  # pragma: no cover - replaced by the overload in numba
    raise NotImplementedError


@overload(_per_line, inline="always")
def _per_line_overload(array):
    # A constant where it is compiled: from the array's runtime itemsize, the stride took
    # two integer divisions per prefetched row.
    per_line = max(_LINE_BYTES // (array.dtype.bitwidth // 8), 1)
    return lambda array: per_line


@njit(cache=True, nogil=True, inline="always")
def prefetch_row(array: np.ndarray, row: int) -> None:
    """Prefetch every cache line of ``array[row]`` (a 2-D array with contiguous rows)."""
    width = array.shape[1]
    per_line = _per_line(array)
    for col in range(0, width, per_line):
        _prefetch2(array, row, col)


@njit(cache=True, nogil=True, inline="always")
def prefetch_item(array: np.ndarray, index: int) -> None:
    """Prefetch the cache line of ``array[index]`` (a 1-D array, any stride)."""
    _prefetch1(array, index)


# -- lookup -----------------------------------------------------------------------------


@njit(cache=True, nogil=True, error_model="numpy")
def initial_rows_into(ids: np.ndarray, seed_salt: np.uint64, column_keys: np.ndarray,
                      lower: np.float32, span: np.float32, top: np.float32,
                      out: np.ndarray) -> None:
    """``out[i, d]``: uniform float32 of ``(ids[i], d, seed)``; see ``initializer``."""
    dim = column_keys.shape[0]
    unit_scale = np.float32(2.0**-24)
    for i in range(ids.shape[0]):
        key = mix64_one(ids[i] ^ seed_salt)
        for d in range(dim):
            bits = mix64_one(key ^ column_keys[d])
            unit = np.float32(bits >> _S40) * unit_scale
            value = lower + span * unit
            out[i, d] = value if value < top else top


# -- update -----------------------------------------------------------------------------


@njit(cache=True, nogil=True, error_model="numpy")
def _rows_repeat(rows: np.ndarray, num_rows: int) -> bool:
    """Whether a row ``>= 0`` occurs twice in ``rows`` (all ``< num_rows``).

    One bit per table row: the bitmap of even a 4M-row shard (512 KB) stays in cache,
    so this is ~4x cheaper than the hashing in :func:`sum_duplicate_rows`, and most
    batches (the embedding worker sends distinct ids) stop here. Where the bitmap would
    be large beside the batch (a few ids a table from a big shard), a hash set of the
    batch's rows instead: answering "maybe" there sent every such batch the slow way.
    """
    if num_rows > 64 * rows.shape[0]:
        return _rows_repeat_hashed(rows)
    seen = np.zeros((num_rows >> 6) + 1, np.uint64)
    one = np.uint64(1)
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            continue
        word = r >> 6
        bit = one << np.uint64(r & 63)
        if seen[word] & bit:
            return True
        seen[word] |= bit
    return False


@njit(cache=True, nogil=True, error_model="numpy")
def _rows_repeat_hashed(rows: np.ndarray) -> bool:
    """:func:`_rows_repeat` by an open-addressing set of at least twice the batch's
    slots (rows are the shard's own numbers, not a caller's: no crafted collisions)."""
    size, bits = 16, 4
    while size < 2 * rows.shape[0]:
        size, bits = size << 1, bits + 1
    shift = np.uint64(64 - bits)
    mask = size - 1
    table = np.full(size, -1, np.int64)
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            continue
        s = np.int64((np.uint64(r) * _GOLDEN64) >> shift)
        while table[s] >= 0:
            if table[s] == r:
                return True
            s = (s + 1) & mask
        table[s] = r
    return False


def sum_duplicate_rows(rows: np.ndarray, grads: np.ndarray, num_rows: int
                       ) -> tuple[np.ndarray, np.ndarray, bool]:
    """Distinct found rows and the sum of their gradients, in order of first position.

    Rows -1 (ids not stored) are dropped; every row is ``< num_rows``. ``grads`` float32,
    or float16 as int16 bits (:func:`row_types.kernel_view`); sums are float32. When no
    row repeats, returns ``rows`` and ``grads`` themselves (no copy) with ``False``; the
    caller then skips rows < 0.
    """
    if not _rows_repeat(rows, num_rows):
        return rows, grads, False
    unique, inverse = rows_in_order(rows)
    if unique.shape[0] == np.count_nonzero(inverse >= 0):
        return rows, grads, False
    return unique, _sum_by_group(inverse, grads, unique.shape[0]), True


@njit(cache=True, nogil=True, error_model="numpy")
def _sum_by_group(inverse: np.ndarray, grads: np.ndarray, num_groups: int) -> np.ndarray:
    """Row ``j`` of the result: the sum of ``grads[i]`` over ``inverse[i] == j``."""
    out = np.zeros((num_groups, grads.shape[1]), np.float32)
    for i in range(inverse.shape[0]):
        j = inverse[i]
        if j < 0:
            continue
        for d in range(grads.shape[1]):
            out[j, d] += widen(grads[i, d])
    return out


@njit(cache=True, nogil=True, inline="always")
def _clamp(value: np.float32, bound: np.float32) -> np.float32:
    """``value`` clamped to ``[-bound, bound]`` (NaN passes through). Each comparison is
    written in the operand order of x86's ``minps``/``maxps``, so each side is one
    instruction; written as two tests of ``value``, the pair took four."""
    below = bound if bound < value else value
    return -bound if -bound > below else below


@njit(cache=True, nogil=True, error_model="numpy")
def sgd_step(weights: np.ndarray, rows: np.ndarray, grads: np.ndarray, stamps: np.ndarray,
             tick: int, ids: np.ndarray, sr_key: np.uint64, stochastic: bool,
             lr: np.float32, weight_decay: np.float32, bound: np.float32) -> int:
    """``w -= lr * (g + weight_decay * w)``, clamped to ``[-bound, bound]``; in place.

    ``ids`` (the id of ``rows[i]``), ``sr_key`` and ``stochastic`` say how values are
    rounded back into half-precision rows (``row_types``); float32 rows ignore them.
    """
    n = rows.shape[0]
    dim = weights.shape[1]
    rounding = rounding_args(weights, stochastic)
    count = 0
    for i in range(n):
        if i + PREFETCH_AHEAD < n and rows[i + PREFETCH_AHEAD] >= 0:
            prefetch_row(weights, rows[i + PREFETCH_AHEAD])
            prefetch_item(stamps, rows[i + PREFETCH_AHEAD])
        r = rows[i]
        if r < 0:
            continue
        count += 1
        # SGD keeps no state: the table's step tells its updates apart.
        key = row_key(weights[r, 0], ids[i], tick, sr_key)
        for d in range(dim):
            old = weights[r, d]
            w = widen(old)
            grad = widen(grads[i, d])
            g = grad + weight_decay * w
            weights[r, d] = narrow(_clamp(w - lr * g, bound), old, key, grad, rounding)
            key = next_column_key(key)
        stamps[r] = tick
    return count


SGD, ADAGRAD, ADAM = 0, 1, 2
"""Values of :func:`adaptive_step`'s ``kind`` (SGD: :func:`sgd_step`'s, for callers that
pick the kernel by kind)."""


@njit(cache=True, nogil=True, error_model="numpy")
def adaptive_step(kind: int, weights: np.ndarray, state: np.ndarray, rows: np.ndarray,
                   grads: np.ndarray, stamps: np.ndarray, tick: int, ids: np.ndarray,
                   sr_key: np.uint64, stochastic: bool, lr: np.float32,
                   weight_decay: np.float32, bound: np.float32, eps: np.float32,
                   momentum: np.float32, beta1: float, beta2: float) -> int:
    """One Adagrad or Adam step on ``weights[rows]`` in place; rows < 0 are skipped.
    Returns the number of rows stepped. Every weight is clamped to ``[-bound, bound]``
    and rounded back into half-precision rows as :func:`sgd_step` says.

    * ``ADAGRAD``: ``acc = momentum * acc + g**2``, ``w -= lr * g / (sqrt(acc) + eps)``;
      one accumulator per row (the mean of ``g**2``) when ``state`` has one column.
    * ``ADAM``: ``state[r] = [m (dim), v (dim), t]`` with per-row bias correction.

    One loop for all: the branch on ``kind`` goes the same way for every row and costs
    nothing measurable, where helpers taking the arrays, called per row, cost 10-15 %.
    The state after the step keys the row's rounding (checkpoints and log replays restore
    it; the table's step, which evaluation lookups advance, would not do): Adagrad and
    Adam key by column 0's, computed first, and step the row in one pass; row-wise
    Adagrad's accumulator needs the whole row's gradients, so its weights take a second.
    """
    n = rows.shape[0]
    dim = weights.shape[1]
    shared = state.shape[1] == 1 and dim > 1
    b1, b2 = np.float32(beta1), np.float32(beta2)
    one_minus_b1, one_minus_b2 = np.float32(1.0 - beta1), np.float32(1.0 - beta2)
    g_row = np.empty(dim, np.float32)
    rounding = rounding_args(weights, stochastic)
    count = 0
    for i in range(n):
        if i + PREFETCH_AHEAD < n and rows[i + PREFETCH_AHEAD] >= 0:
            ahead = rows[i + PREFETCH_AHEAD]
            prefetch_row(weights, ahead)
            prefetch_row(state, ahead)
            prefetch_item(stamps, ahead)
        r = rows[i]
        if r < 0:
            continue
        count += 1
        if kind == ADAGRAD and shared:
            # The gradients first, in a loop of their own that vectorizes (widening float16
            # element by element inside the sum's loop keeps it from vectorizing); the key
            # needs the row's new accumulator, so the weights take a second pass.
            for d in range(dim):
                g_row[d] = widen(grads[i, d]) + weight_decay * widen(weights[r, d])
            mean_g2 = np.float32(0.0)
            for d in range(dim):
                mean_g2 += g_row[d] * g_row[d]
            state[r, 0] = momentum * state[r, 0] + mean_g2 / np.float32(dim)
            key = row_key(weights[r, 0], ids[i], np.float32(state[r, 0]).view(np.uint32), sr_key)
            denom = np.sqrt(state[r, 0]) + eps
            for d in range(dim):
                old = weights[r, d]
                value = _clamp(widen(old) - lr * g_row[d] / denom, bound)
                weights[r, d] = narrow(value, old, key, widen(grads[i, d]), rounding)
                key = next_column_key(key)
        elif kind == ADAGRAD:
            # One pass: the rounding key needs only column 0's new state, computed first
            # with the loop's own operations (so the same bits).
            g0 = widen(grads[i, 0]) + weight_decay * widen(weights[r, 0])
            acc0 = momentum * state[r, 0] + g0 * g0
            key = row_key(weights[r, 0], ids[i], np.float32(acc0).view(np.uint32), sr_key)
            for d in range(dim):
                old = weights[r, d]
                w = widen(old)
                grad = widen(grads[i, d])
                g = grad + weight_decay * w
                acc = momentum * state[r, d] + g * g
                state[r, d] = acc
                value = _clamp(w - lr * g / (np.sqrt(acc) + eps), bound)
                weights[r, d] = narrow(value, old, key, grad, rounding)
                key = next_column_key(key)
        else:
            # One pass too: the key is m[0] after the step. m and v as row views: indexed
            # ``dim + d`` the compiler cannot rule out a negative index and gathers.
            t = state[r, 2 * dim] + np.float32(1.0)
            state[r, 2 * dim] = t
            m, v = state[r, :dim], state[r, dim:2 * dim]
            g0 = widen(grads[i, 0]) + weight_decay * widen(weights[r, 0])
            m0 = b1 * m[0] + one_minus_b1 * g0
            key = row_key(weights[r, 0], ids[i], np.float32(m0).view(np.uint32), sr_key)
            # Bias corrections in float64: 1 - b2**t is tiny for small t and loses digits in f32.
            correction1 = np.float32(1.0 - beta1**np.float64(t))
            correction2 = np.float32(1.0 - beta2**np.float64(t))
            for d in range(dim):
                old = weights[r, d]
                w = widen(old)
                grad = widen(grads[i, d])
                g = grad + weight_decay * w
                m_new = b1 * m[d] + one_minus_b1 * g
                v_new = b2 * v[d] + one_minus_b2 * (g * g)
                m[d] = m_new
                v[d] = v_new
                value = _clamp(w - lr * (m_new / correction1) / (np.sqrt(v_new / correction2) + eps),
                               bound)
                weights[r, d] = narrow(value, old, key, grad, rounding)
                key = next_column_key(key)
        stamps[r] = tick
    return count


@njit(cache=True, nogil=True, error_model="numpy")
def gather_rows_at(weights: np.ndarray, rows: np.ndarray, positions: np.ndarray,
                   out: np.ndarray, stamps: np.ndarray, tick: int) -> int:
    """``out[positions[i]] = weights[rows[i]]`` (zeros where ``rows[i] < 0``), stamping
    each row read; returns how many rows were found. Bits are copied as they are when
    ``out`` has the element type of ``weights``, else converted
    (:func:`row_types.as_answered`: half rows widened, float32 ones narrowed to float16)."""
    n = rows.shape[0]
    dim = weights.shape[1]
    found = 0
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            ahead = rows[i + PREFETCH_AHEAD]
            if ahead >= 0:
                prefetch_row(weights, ahead)
                prefetch_item(stamps, ahead)
        r = rows[i]
        p = positions[i]
        if r < 0:
            for d in range(dim):
                out[p, d] = 0.0
            continue
        found += 1
        for d in range(dim):
            out[p, d] = as_answered(weights[r, d], out[p, d])
        stamps[r] = tick
    return found


# -- insertion and admission --------------------------------------------------------------


@njit(cache=True, nogil=True)
def scatter_rows(dst: np.ndarray, rows: np.ndarray, src: np.ndarray,
                 positions: np.ndarray) -> None:
    """``dst[rows[i]] = src[positions[i]]`` for every ``i``, in one pass (numpy's
    ``dst[rows] = src[positions]`` builds the gathered rows first)."""
    n = rows.shape[0]
    width = src.shape[1]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            prefetch_row(dst, rows[i + PREFETCH_AHEAD])
        r = rows[i]
        p = positions[i]
        for d in range(width):
            dst[r, d] = src[p, d]


@njit(cache=True, nogil=True, error_model="numpy")
def count_sightings(sketch: np.ndarray, salts: np.ndarray, ids: np.ndarray,
                    threshold: int) -> np.ndarray:
    """Count one sighting of each id in a count-min sketch; True where it reached ``threshold``.

    ``sketch`` is ``(depth, width)`` uint8 (width a power of two), saturating at 255.
    Conservative update (raise only the counters below the new estimate) keeps the
    overestimate from hash collisions small; an estimate is never below the true count.
    """
    depth, width = sketch.shape
    mask = np.uint64(width - 1)
    passed = np.empty(ids.shape[0], np.bool_)
    cells = np.empty(depth, np.int64)
    for i in range(ids.shape[0]):
        low = 255
        for k in range(depth):
            c = np.int64(mix64_one(ids[i] ^ salts[k]) & mask)
            cells[k] = c
            if sketch[k, c] < low:
                low = sketch[k, c]
        estimate = min(low + 1, 255)
        for k in range(depth):
            if sketch[k, cells[k]] < estimate:
                sketch[k, cells[k]] = estimate
        passed[i] = estimate >= threshold
    return passed


@njit(cache=True, nogil=True, error_model="numpy")
def sketch_estimates(sketch: np.ndarray, salts: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The count-min estimate of each id (the least of its ``depth`` counters), as
    :func:`count_sightings` counts them; the sketch is only read."""
    depth, width = sketch.shape
    mask = np.uint64(width - 1)
    out = np.empty(ids.shape[0], np.uint8)
    for i in range(ids.shape[0]):
        low = 255
        for k in range(depth):
            v = sketch[k, np.int64(mix64_one(ids[i] ^ salts[k]) & mask)]
            if v < low:
                low = v
        out[i] = low
    return out

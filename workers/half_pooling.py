"""Pooling of float16 rows as they arrived from the parameter servers (numba), forward
and backward, for the slots :func:`persia_py.workers.slots.pooled_by_kernel` picks.

Rows travel as float16 (``embedding_fp16``). Widened to float32 when they arrive, a batch's
rows take twice the memory, and their gradients, float32 again, are narrowed to float16
for the way back: two passes over every row, plus the pooling's own. These kernels read the
float16 rows where pooling reads them and write the gradients as float16 where the
backward writes them, so neither copy is made. Results are those of the float32 path:
widening is exact, sums are float32 in the order ``F.embedding_bag`` adds, and each
gradient is rounded once to nearest even, as the cast to the wire does; bit for bit,
but for weighted entries (``sqrt_scaling``, mean over hash-stacked ids), which round
once each by a fused multiply-add as ``embedding_bag``'s x86 kernel does: the same bits
there, within a rounding per entry where its kernel multiplies and adds apart.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from persia_py.ops.f16 import f16_bits, f16_value, fma32
from persia_py.workers.entry_grads import sum_entry_grads

__all__ = ["entry_grads_as_halves", "pool_halves"]


@njit(cache=True, nogil=True)
def pool_halves(rows: np.ndarray, index: np.ndarray, entries: np.ndarray,
                weights: np.ndarray, mean: bool, out: np.ndarray) -> None:
    """``out[b]``: the sum of ``rows[index[e]] * weights[e]`` (or unweighted) over the
    entries ``e`` of sample ``b``, divided by their number for ``mean`` (0 for a sample
    without entries), in float32; ``rows`` are float16 bits (int16)."""
    weighted = weights.shape[0] > 0
    dim = rows.shape[1]
    if entries.sum() != index.shape[0] or (weighted and weights.shape[0] != index.shape[0]):
        raise ValueError("pooling: the entries per sample do not add up to the index")
    e = 0
    for b in range(entries.shape[0]):
        for d in range(dim):
            out[b, d] = 0
        for _ in range(entries[b]):
            r = index[e]
            if r < 0 or r >= rows.shape[0]:
                raise ValueError("pooling: an index entry past the rows")
            if weighted:
                w = weights[e]
                for d in range(dim):
                    out[b, d] = fma32(f16_value(rows[r, d]), w, out[b, d])
            else:
                for d in range(dim):
                    out[b, d] += f16_value(rows[r, d])
            e += 1
        if mean and entries[b] > 0:
            count = np.float32(entries[b])
            for d in range(dim):
                out[b, d] /= count


@njit(cache=True, nogil=True)
def entry_grads_as_halves(grad: np.ndarray, index: np.ndarray, entries: np.ndarray,
                          weights: np.ndarray, mean: bool, scratch: np.ndarray,
                          out: np.ndarray) -> None:
    """:func:`sum_entry_grads` into ``scratch`` (float32, the rows' shape, contents not
    read), then each row's sum rounded to float16 bits (int16) into ``out``."""
    sum_entry_grads(grad, index, entries, weights, mean, scratch)
    for r in range(scratch.shape[0]):
        for d in range(scratch.shape[1]):
            out[r, d] = f16_bits(scratch[r, d])

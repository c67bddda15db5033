"""The one-pass CPU backward of pooling over several ids per sample (numba), apart from
:mod:`persia_py.workers.pooling` so that a rank imports numba only when it runs it."""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["sum_entry_grads"]


@njit(cache=True, nogil=True)
def sum_entry_grads(grad: np.ndarray, index: np.ndarray, entries: np.ndarray,
                    weights: np.ndarray, mean: bool, out: np.ndarray) -> None:
    """``out`` set to zeros, then ``out[index[e]] += grad[b] * weights[e]`` (or ``/
    entries[b]`` for ``mean``, or as it is) for every entry ``e`` of every sample ``b``, in
    order of ``e``: the additions ``index_add_`` of the gathered gradients onto zeros
    makes, without gathering them. ``out``'s contents are never read before being set:
    a row is zeroed at its first entry, while in cache, and rows without entries at the
    end, so the caller need not zero ``out`` in a pass of its own over memory."""
    weighted = weights.shape[0] > 0
    dim = grad.shape[1]
    if entries.sum() != index.shape[0] or (weighted and weights.shape[0] != index.shape[0]):
        raise ValueError("pooling backward: the entries per sample do not add up to the index")
    zeroed = np.zeros(out.shape[0], np.bool_)
    e = 0
    for b in range(entries.shape[0]):
        count = np.float32(max(entries[b], 1))
        for _ in range(entries[b]):
            r = index[e]
            if r < 0 or r >= out.shape[0]:
                raise ValueError("pooling backward: an index entry past the rows")
            if not zeroed[r]:
                zeroed[r] = True
                for d in range(dim):
                    out[r, d] = 0
            if weighted:
                w = weights[e]
                for d in range(dim):
                    out[r, d] += grad[b, d] * w
            elif mean:
                for d in range(dim):
                    out[r, d] += grad[b, d] / count
            else:
                for d in range(dim):
                    out[r, d] += grad[b, d]
            e += 1
    for r in range(out.shape[0]):
        if not zeroed[r]:
            for d in range(dim):
                out[r, d] = 0

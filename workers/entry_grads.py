"""The one-pass CPU backward of pooling over several ids per sample (numba), apart from
:mod:`persia_py.workers.pooling` so that a rank imports numba only when it runs it."""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["add_entry_grads"]


@njit(cache=True, nogil=True)
def add_entry_grads(grad: np.ndarray, index: np.ndarray, entries: np.ndarray,
                    weights: np.ndarray, mean: bool, out: np.ndarray) -> None:
    """``out[index[e]] += grad[b] * weights[e]`` (or ``/ entries[b]`` for ``mean``, or as
    it is) for every entry ``e`` of every sample ``b``, in order of ``e``: the additions
    ``index_add_`` of the gathered gradients makes, without gathering them."""
    weighted = weights.shape[0] > 0
    dim = grad.shape[1]
    if entries.sum() != index.shape[0] or (weighted and weights.shape[0] != index.shape[0]):
        raise ValueError("pooling backward: the entries per sample do not add up to the index")
    e = 0
    for b in range(entries.shape[0]):
        count = np.float32(max(entries[b], 1))
        for _ in range(entries[b]):
            r = index[e]
            if r < 0 or r >= out.shape[0]:
                raise ValueError("pooling backward: an index entry past the rows")
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

"""Whether an array of gradients from the wire holds only finite values, fast for float16.

numpy has no float16 arithmetic of its own: ``np.isfinite`` of float16 converts value by
value, and a test on the exponent bits with numpy's operators builds temporaries as
large as the array. Both roles that receive gradients (the embedding worker from the NN
workers, the parameter servers from the embedding workers) check every one.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_F16_EXPONENT = np.int16(0x7C00)


@njit(cache=True, nogil=True)
def _finite_halves(bits: np.ndarray) -> bool:
    """Whether no float16 of ``bits`` (their int16 patterns, 1-D) has an exponent of all
    ones (infinity or NaN). No early exit, so the loop vectorizes."""
    bad = False
    for i in range(bits.shape[0]):
        bad |= (bits[i] & _F16_EXPONENT) == _F16_EXPONENT
    return not bad


def all_finite(array: np.ndarray) -> bool:
    """No NaN or infinity in ``array`` (a float array of any shape)."""
    if array.dtype == np.float16:
        return bool(_finite_halves(np.ascontiguousarray(array).view(np.int16).reshape(-1)))
    return bool(np.isfinite(array).all())


__all__ = ["all_finite"]

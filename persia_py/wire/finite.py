"""Whether an array of gradients from the wire holds only finite values, fast for float16.

numpy has no float16 arithmetic of its own: ``np.isfinite`` of float16 converts value by
value, and a test on the exponent bits with numpy's operators builds temporaries as
large as the array. Both roles that receive gradients (the embedding worker from the NN
workers, the parameter servers from the embedding workers) check every one.
"""

from __future__ import annotations

import numpy as np
from numba import njit

F16_EXPONENT, BF16_EXPONENT = 0x7C00, 0x7F80
"""The exponent fields of float16 and bfloat16 bit patterns: all ones is infinity or NaN."""


@njit(cache=True, nogil=True)
def _finite_halves(bits: np.ndarray, exponent: np.int16) -> bool:
    """Whether no 16-bit pattern of ``bits`` (int16, 1-D) has all of ``exponent``'s bits
    set. No early exit, so the loop vectorizes."""
    bad = False
    for i in range(bits.shape[0]):
        bad |= (bits[i] & exponent) == exponent
    return not bad


def halves_finite(array: np.ndarray, exponent: int) -> bool:
    """No infinity or NaN in ``array``, 16-bit floats of any shape (float16, or bfloat16
    kept as uint16) whose exponent field is ``exponent`` (:data:`F16_EXPONENT`,
    :data:`BF16_EXPONENT`)."""
    bits = np.ascontiguousarray(array).view(np.int16).reshape(-1)
    return bool(_finite_halves(bits, np.int16(exponent)))


def all_finite(array: np.ndarray) -> bool:
    """No NaN or infinity in ``array`` (a float array of any shape)."""
    if array.dtype == np.float16:
        return halves_finite(array, F16_EXPONENT)
    return bool(np.isfinite(array).all())


__all__ = ["BF16_EXPONENT", "F16_EXPONENT", "all_finite", "halves_finite"]

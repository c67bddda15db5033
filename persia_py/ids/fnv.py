"""The compiled passes of :func:`persia_py.ids.fnv1a64` (numba), apart from the package so
that importing :mod:`persia_py.ids` does not import numba."""

from __future__ import annotations

import numpy as np
from numba import njit

from persia_py.ids import FNV_OFFSET, FNV_PRIME

__all__ = ["fnv1a64_rows", "fnv1a64_utf8_rows"]


@njit(inline="always")
def _fnv_byte(h: np.uint64, byte: int) -> np.uint64:
    return (h ^ np.uint64(byte)) * FNV_PRIME


@njit(inline="always")
def _row_length(data: np.ndarray, i: int) -> int:
    """Row ``i``'s length: up to its last non-zero element (numpy's strings are padded
    with zeros)."""
    length = data.shape[1]
    while length > 0 and data[i, length - 1] == 0:
        length -= 1
    return length


@njit(cache=True, nogil=True)
def fnv1a64_rows(data: np.ndarray) -> np.ndarray:
    """FNV-1a 64 of each row of a uint8 matrix, up to its last non-zero byte."""
    out = np.empty(data.shape[0], np.uint64)
    for i in range(data.shape[0]):
        h = FNV_OFFSET
        for j in range(_row_length(data, i)):
            h = _fnv_byte(h, data[i, j])
        out[i] = h
    return out


@njit(cache=True, nogil=True)
def fnv1a64_utf8_rows(data: np.ndarray) -> np.ndarray:
    """FNV-1a 64 of the UTF-8 encoding of each row of a matrix of code points (numpy's
    ``U`` dtype viewed as uint32), up to its last non-zero code point: the same hash as
    of the encoded bytes, without encoding them first."""
    out = np.empty(data.shape[0], np.uint64)
    for i in range(data.shape[0]):
        h = FNV_OFFSET
        for j in range(_row_length(data, i)):
            c = int(data[i, j])
            if c < 0x80:
                h = _fnv_byte(h, c)
            elif c < 0x800:
                h = _fnv_byte(_fnv_byte(h, 0xC0 | (c >> 6)), 0x80 | (c & 0x3F))
            elif c < 0x10000:
                h = _fnv_byte(h, 0xE0 | (c >> 12))
                h = _fnv_byte(_fnv_byte(h, 0x80 | ((c >> 6) & 0x3F)), 0x80 | (c & 0x3F))
            else:
                h = _fnv_byte(_fnv_byte(h, 0xF0 | (c >> 18)), 0x80 | ((c >> 12) & 0x3F))
                h = _fnv_byte(_fnv_byte(h, 0x80 | ((c >> 6) & 0x3F)), 0x80 | (c & 0x3F))
        out[i] = h
    return out

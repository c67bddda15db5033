"""Checksums of update-log records: zlib's crc32, or ``lanes64``, a multi-lane hash that
runs at about the speed memory feeds it.

Why: a parameter server appends every update it applies (tens of MB per training batch)
to its update log and checksums each record, so that a record cut short by a crash or a
damaged block is found on replay. zlib's crc32 (without carry-less multiply, as most
distributions build it) reads a few GB/s: it cost the server more than the copy and the
write of the record together (docs/benchmarks.md#update-log).

``lanes64``: the record's 64-bit words (little-endian) go in turn to eight lanes; each
lane takes its words through xxh64's round, ``acc = rotl(acc + word * P2, 31) * P1``; then
the length, the eight lanes, the words past the last whole stripe of eight and the last
bytes (zero-padded to a word) are folded one after the other with :func:`mix64_one`.
Every step is a bijection of the word it takes in and of the state it carries, so
changing any one word (or the length) always changes the 64-bit hash; the frame keeps 32
bits of it (its two halves xored), which then miss a damage one time in 2**32, as crc32
does for damage wider than 32 bits. Neither is a MAC: the log lies in a folder only its
server writes, and the check is for accidents, not for an adversary.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np
from numba import njit

from persia_py.ids.hashing import mix64_one

CRC32 = "crc32"
LANES64 = "lanes64"

_P1, _P2 = np.uint64(0x9E3779B185EBCA87), np.uint64(0xC2B2AE3D27D4EB4F)
_ROT, _ROT_BACK = np.uint64(31), np.uint64(33)
_LOW32, _HALF, _BYTE = np.uint64(0xFFFFFFFF), np.uint64(32), np.uint64(8)


@njit(cache=True, nogil=True, inline="always")
def _round(acc: np.uint64, word: np.uint64) -> np.uint64:
    acc = acc + word * _P2
    return ((acc << _ROT) | (acc >> _ROT_BACK)) * _P1


@njit(cache=True, nogil=True, inline="always")
def _fold(h: np.uint64, word: np.uint64) -> np.uint64:
    return mix64_one(h ^ (word * _P2))


@njit(cache=True, nogil=True)
def _lanes64(words: np.ndarray, tail: np.ndarray, nbytes: int) -> np.uint64:
    """The 64-bit hash of a record: ``words`` its whole 64-bit words, ``tail`` the bytes
    after them (fewer than 8), ``nbytes`` its length. Eight scalar lanes rather than an
    array: LLVM keeps them in registers."""
    a0, a1, a2, a3 = _P1, _P2, _P1 + _P2, _P1 - _P2
    a4, a5, a6, a7 = ~_P1, ~_P2, _P1 * _P2, _P1 ^ _P2
    whole = words.size - words.size % 8
    for s in range(0, whole, 8):
        a0 = _round(a0, words[s])
        a1 = _round(a1, words[s + 1])
        a2 = _round(a2, words[s + 2])
        a3 = _round(a3, words[s + 3])
        a4 = _round(a4, words[s + 4])
        a5 = _round(a5, words[s + 5])
        a6 = _round(a6, words[s + 6])
        a7 = _round(a7, words[s + 7])
    h = mix64_one(np.uint64(nbytes))
    for lane in (a0, a1, a2, a3, a4, a5, a6, a7):
        h = mix64_one(h ^ lane)
    for i in range(whole, words.size):
        h = _fold(h, words[i])
    if tail.size:
        last = np.uint64(0)
        for j in range(tail.size):
            last |= np.uint64(tail[j]) << (_BYTE * np.uint64(j))
        h = _fold(h, last)
    return (h ^ (h >> _HALF)) & _LOW32


def lanes64(data) -> int:
    """The 32-bit ``lanes64`` check of ``data`` (bytes-like; see the module docstring)."""
    view = np.frombuffer(data, np.uint8)
    whole = view.size - view.size % 8
    return int(_lanes64(view[:whole].view(np.uint64), view[whole:], view.size))


def crc32(data) -> int:
    """zlib's crc32 of ``data`` (bytes-like)."""
    return zlib.crc32(data)


SUMS: dict[str, Callable[[object], int]] = {CRC32: crc32, LANES64: lanes64}
"""The checks a record's frame may carry, by the name a segment's header gives."""


__all__ = ["CRC32", "LANES64", "SUMS", "crc32", "lanes64"]

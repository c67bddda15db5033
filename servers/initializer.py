"""Deterministic initial embedding values.

Each value is a pure function of ``(id, column, seed)``, so a row comes out the same
whichever replica or internal shard creates it, in whatever batch order, and a table
rebuilt after eviction re-creates an evicted id with the value it first had.
"""

from __future__ import annotations

import numpy as np

from persia_py.routing import mix64

_U64 = (1 << 64) - 1
# Distinct salts keep the per-id key and the per-column stream uncorrelated.
_COLUMN_SALT = np.uint64(0x452821E638D01377)
_MANTISSA_SHIFT = np.uint64(64 - 24)  # float32 holds 24-bit integers exactly


def initial_rows(ids: np.ndarray, dim: int, lower: float, upper: float, seed: int) -> np.ndarray:
    """Rows of shape ``(len(ids), dim)``, float32, uniform in ``[lower, upper)``.

    ``lower == upper`` gives a constant fill, handy for zero initialization.
    """
    if not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be a positive int, got {dim!r}")
    if not (np.isfinite(lower) and np.isfinite(upper) and lower <= upper):
        raise ValueError(f"need finite lower <= upper, got lower={lower}, upper={upper}")
    ids = np.asarray(ids, dtype=np.uint64).reshape(-1)
    lo, hi = np.float32(lower), np.float32(upper)
    if lo == hi:
        return np.full((ids.shape[0], dim), lo, dtype=np.float32)
    key = mix64(ids, int(seed) & _U64)
    columns = mix64(np.arange(dim, dtype=np.uint64), _COLUMN_SALT)
    bits = mix64(key[:, None] ^ columns[None, :])
    unit = (bits >> _MANTISSA_SHIFT).astype(np.float32) * np.float32(2.0**-24)
    out = lo + (hi - lo) * unit
    # Rounding of lo + span * unit may land exactly on ``upper``; keep the interval open.
    np.minimum(out, np.nextafter(hi, lo), out=out)
    return out

"""Deterministic initial embedding values.

Each value is a pure function of ``(id, column, seed)``, so a row comes out the same
whichever replica or internal shard creates it, in whatever batch order, and a table
rebuilt after eviction re-creates an evicted id with the value it first had.
"""

from __future__ import annotations

import functools

import numpy as np

from persia_py.ids.hashing import INIT_COLUMN_SALT, mix64
from persia_py.servers.kernels import initial_rows_into

_U64 = (1 << 64) - 1


def initial_rows(ids: np.ndarray, dim: int, lower: float, upper: float, seed: int,
                 out: np.ndarray | None = None) -> np.ndarray:
    """Rows of shape ``(len(ids), dim)``, float32, uniform in ``[lower, upper)``.

    ``lower == upper`` gives a constant fill, handy for zero initialization. With
    ``out`` (float32, that shape, C-contiguous) the rows are written there and it is
    returned. Value ``[i, d]`` is ``lower + (upper - lower) * u`` with ``u`` the top 24
    bits of ``mix64(mix64(id ^ seed) ^ mix64(d ^ column salt))`` over 2**24 (one numba
    pass over the ids; no temporary array per value).
    """
    if not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be a positive int, got {dim!r}")
    if not (np.isfinite(lower) and np.isfinite(upper) and lower <= upper):
        raise ValueError(f"need finite lower <= upper, got lower={lower}, upper={upper}")
    ids = np.ascontiguousarray(np.asarray(ids, dtype=np.uint64).reshape(-1))
    if out is None:
        out = np.empty((ids.shape[0], dim), dtype=np.float32)
    elif (out.dtype != np.float32 or out.shape != (ids.shape[0], dim)
          or not out.flags.c_contiguous):
        raise ValueError(f"out must be C-contiguous float32 of shape {(ids.shape[0], dim)}")
    lo, hi = np.float32(lower), np.float32(upper)
    if lo == hi:
        out[...] = lo
        return out
    columns = _column_keys(dim)
    # Rounding of lo + span * unit may land exactly on ``upper``; keep the interval open.
    top = np.nextafter(hi, lo)
    initial_rows_into(ids, np.uint64(int(seed) & _U64), columns, lo, np.float32(hi - lo),
                      np.float32(top), out)
    return out


@functools.lru_cache(maxsize=64)
def _column_keys(dim: int) -> np.ndarray:
    """``mix64(d ^ column salt)`` of every column ``d`` (read-only): made once per
    ``dim``, not again for every batch that inserts rows."""
    keys = mix64(np.arange(dim, dtype=np.uint64), INIT_COLUMN_SALT)
    keys.flags.writeable = False
    return keys

"""The rows an ``EmbeddingTable`` exports and imports (checkpoints, increments, handovers).

Exported rows are a dict of arrays (:func:`exported_rows`); imported ones are checked
whole before anything is stored (:func:`check_import`), so that a bad file or request
changes nothing and says what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from persia_py.ids.dedup import repeated_id
from persia_py.servers import row_types

MAX_CLOCK = 2**62
"""Largest LRU clock value a table accepts from outside (import_rows): far from int64's
end, so that counting on from it never overflows."""


def exported_rows(parts: Sequence[tuple[np.ndarray, ...]], clock: int, row_dtype: str
                  ) -> dict[str, np.ndarray | int | str]:
    """The export of rows copied shard by shard as ``(ids, weights, state, last_access)``
    (absolute stamps), at table clock ``clock``."""
    ids, weights, state, stamps = (np.concatenate(p) for p in zip(*parts))
    return {"ids": ids, "weights": weights, "state": state, "last_access": stamps,
            "clock": clock, "row_dtype": row_dtype}


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int if it is one (not a bool) and at least ``minimum``;
    ValueError naming ``name`` otherwise."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_import(ids: np.ndarray, weights: np.ndarray, state: np.ndarray,
                 last_access: np.ndarray | None, clock: int, row_dtype: str, *, dim: int,
                 state_width: int, table_dtype: str) -> tuple[np.ndarray, np.ndarray, int]:
    """Imported rows of checked ``ids`` as a table of ``table_dtype`` stores them:
    ``(weights converted, last_access int64, clock)``; ValueError says what is wrong
    (see :meth:`persia_py.servers.storage.EmbeddingTable.import_rows`)."""
    n = ids.shape[0]
    row_dtype = row_types.check_row_dtype(row_dtype)
    _check_array("weights", weights, row_types.numpy_dtype(row_dtype), (n, dim))
    _check_array("state", state, np.dtype(np.float32), (n, state_width))
    stamps, clock = check_stamps(last_access, clock, n)
    if not row_types.all_finite(weights, row_dtype):
        raise ValueError("weights contain NaN or infinite values")
    if not bool(np.isfinite(state).all()):
        raise ValueError("state contain NaN or infinite values")
    weights = row_types.convert(weights, row_dtype, table_dtype)
    repeat = repeated_id(ids)
    if repeat is not None:
        raise ValueError(f"ids are not distinct: id {repeat} repeats")
    return weights, stamps, clock


def check_stamps(last_access: np.ndarray | None, clock: int, n: int) -> tuple[np.ndarray, int]:
    """``(last_access, clock)`` of ``n`` imported rows, checked: ``clock`` an int in ``[0,
    MAX_CLOCK]``, ``last_access`` int64 ``(n,)`` in ``[0, clock]`` (None: zeros)."""
    clock = check_int("clock", clock, 0)
    if clock > MAX_CLOCK:
        raise ValueError(f"clock must be <= {MAX_CLOCK}, got {clock}")
    if last_access is None:
        return np.zeros(n, np.int64), clock
    stamps = _check_array("last_access", last_access, np.dtype(np.int64), (n,))
    if n and not (int(stamps.min()) >= 0 and int(stamps.max()) <= clock):
        raise ValueError(f"last_access must lie in [0, clock={clock}], got "
                         f"[{int(stamps.min())}, {int(stamps.max())}]")
    return stamps, clock


def _check_array(name: str, value: object, dtype: np.dtype, shape: tuple[int, ...]
                 ) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.dtype != dtype or value.shape != shape:
        got = (f"{value.dtype} {value.shape}" if isinstance(value, np.ndarray)
               else type(value).__name__)
        raise ValueError(f"{name} must be {dtype.name} of shape {shape}, got {got}")
    return value

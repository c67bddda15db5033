"""The row arrays of a :class:`persia_py.servers.shard.Shard`: what a shard reads of its
table, and its ids, weights, optimizer state and last-access stamps, reserved as address
space for the shard's whole share where the OS allows (so rows never move to grow),
else allocated small to grow from."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from persia_py.servers import memory, row_types
from persia_py.servers.access_clock import STAMP_DTYPE
from persia_py.servers.optimizers import OptimizerConfig
from persia_py.servers.row_step import RowStep

INITIAL_ROWS = 1024
"""Rows of a shard's arrays at first where they cannot be reserved (then they grow)."""

_DTYPES: dict[str, np.dtype] = {"ids": np.dtype(np.uint64), "weights": np.dtype(np.float32),
                                "state": np.dtype(np.float32), "last_access": STAMP_DTYPE}
"""Element types of a shard's row arrays (weights: of a float32 table)."""


def row_dtypes() -> dict[str, np.dtype]:
    """Element types of a shard's row arrays, by array name (for sizing)."""
    return dict(_DTYPES)


class ShardOwner(Protocol):
    """What a shard reads of its table (:class:`persia_py.servers.storage.EmbeddingTable`)."""

    dim: int
    state_width: int
    row_dtype: str
    optimizer: OptimizerConfig
    init_lower: float
    init_upper: float
    seed: int
    capacity: int
    admit_probability: float
    min_occurrences: int
    row_step: RowStep


def row_arrays(table: ShardOwner, share: int) -> tuple[dict[str, np.ndarray], bool]:
    """A shard's row arrays by name, and whether they hold the whole share (reserved
    address space) rather than ``INITIAL_ROWS`` rows to grow from."""
    shapes = {"ids": (share,), "weights": (share, table.dim),
              "state": (share, table.state_width), "last_access": (share,)}
    dtypes = dict(_DTYPES, weights=row_types.numpy_dtype(table.row_dtype))
    reserved = {name: memory.reserve(shape, dtypes[name]) for name, shape in shapes.items()}
    arrays = {name: array for name, array in reserved.items() if array is not None}
    if len(arrays) == len(shapes):
        return arrays, True
    rows = min(share, INITIAL_ROWS)
    return {name: memory.empty((rows, *shape[1:]), dtypes[name])
            for name, shape in shapes.items()}, False

"""``RowStep``: a table's optimizer step on the rows of one internal shard, in place.

The step is a fused numba kernel (:mod:`persia_py.servers.kernels`), bound to the
table's hyper-parameters once, here, by its optimizer's rule
(:func:`persia_py.servers.optimizers.step_kernel`), not on every update.
"""

from __future__ import annotations

import numpy as np

from persia_py.ids.hashing import ROUNDING_SALT, mix64
from persia_py.servers.optimizers import OptimizerConfig, step_kernel
from persia_py.servers.row_types import kernel_view


class RowStep:
    """The step of one table's optimizer, weight bound and rounding of narrow rows."""

    def __init__(self, optimizer: OptimizerConfig, *, weight_bound: float | None, seed: int,
                 stochastic_rounding: bool) -> None:
        self.step = step_kernel(optimizer, weight_bound)
        self.rounding = (np.uint64(mix64(np.uint64(seed), ROUNDING_SALT)), stochastic_rounding)
        """The key of stochastic rounding (per table seed) and whether it is on."""

    def __call__(self, weights: np.ndarray, state: np.ndarray, rows: np.ndarray,
                 grads: np.ndarray, stamps: np.ndarray, tick: int, ids: np.ndarray) -> int:
        """One optimizer step on ``rows`` (distinct; < 0 skipped) of one shard, in place;
        ``ids[i]``: the id of ``rows[i]`` (ids key stochastic rounding; read in order, where
        the shard's ids by row would cost a cache miss per row). Returns the rows stepped."""
        return self.step(kernel_view(weights), state, rows, grads, stamps, tick, ids,
                         *self.rounding)

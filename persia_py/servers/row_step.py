"""``RowStep``: a table's optimizer step on the rows of one internal shard, in place.

The step is a fused numba kernel (:mod:`persia_py.servers.kernels`): SGD has its own,
Adagrad and Adam share one. The hyper-parameters are converted to the kernel's types
once per table, here, not on every update.
"""

from __future__ import annotations

import numpy as np

from persia_py.ids.hashing import ROUNDING_SALT, mix64
from persia_py.servers import kernels
from persia_py.servers.optimizers import AdagradConfig, AdamConfig, OptimizerConfig, SGDConfig
from persia_py.servers.row_types import kernel_view

_SGD = 0
"""``RowStep.kind`` for SGD (:func:`kernels.sgd_step`); Adagrad and Adam use
:func:`kernels.adaptive_step`'s kinds."""


class RowStep:
    """The step of one table's optimizer, weight bound and rounding of narrow rows."""

    def __init__(self, optimizer: OptimizerConfig, *, weight_bound: float | None, seed: int,
                 stochastic_rounding: bool) -> None:
        self.kind, self.params = _step_args(optimizer, weight_bound)
        self.rounding = (np.uint64(mix64(np.uint64(seed), ROUNDING_SALT)), stochastic_rounding)
        """The key of stochastic rounding (per table seed) and whether it is on."""

    def __call__(self, weights: np.ndarray, state: np.ndarray, rows: np.ndarray,
                 grads: np.ndarray, stamps: np.ndarray, tick: int, ids: np.ndarray) -> int:
        """One optimizer step on ``rows`` (distinct; < 0 skipped) of one shard, in place;
        ``ids[i]``: the id of ``rows[i]`` (ids key stochastic rounding; read in order, where
        the shard's ids by row would cost a cache miss per row). Returns the rows stepped."""
        weights = kernel_view(weights)
        if self.kind == _SGD:
            return kernels.sgd_step(weights, rows, grads, stamps, tick, ids, *self.rounding,
                                    *self.params)
        return kernels.adaptive_step(self.kind, weights, state, rows, grads, stamps, tick, ids,
                                     *self.rounding, *self.params)


def _step_args(cfg: OptimizerConfig, weight_bound: float | None) -> tuple[int, tuple]:
    """The step kernel's kind and its hyper-parameters (those after the rounding)."""
    f32 = np.float32
    lr, weight_decay = f32(cfg.lr), f32(cfg.weight_decay)
    bound = f32(np.inf if weight_bound is None else weight_bound)
    if isinstance(cfg, SGDConfig):
        return _SGD, (lr, weight_decay, bound)
    if isinstance(cfg, AdagradConfig):
        return kernels.ADAGRAD, (lr, weight_decay, bound, f32(cfg.eps),
                                 f32(cfg.g_square_momentum), 0.0, 0.0)
    if isinstance(cfg, AdamConfig):
        return kernels.ADAM, (lr, weight_decay, bound, f32(cfg.eps), f32(0.0),
                              float(cfg.betas[0]), float(cfg.betas[1]))
    raise ValueError(f"unsupported optimizer {type(cfg).__name__}")

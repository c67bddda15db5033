"""Row-wise embedding optimizers on the servers: state layout and the vectorized update.

The hyper-parameter schemas (``SGDConfig``, ``AdagradConfig``, ``AdamConfig``) live in
:mod:`persia_py.config.optimizer`, shared with the user API and the config files.

Optimizer state lives next to the weights as extra float32 columns per row, so the
table can update weights and state with the same row numbers. The table runs the fused
in-place kernels of :mod:`persia_py.servers.kernels`; ``apply_update`` is their numpy
reference (pure: it works on gathered rows and returns new arrays), and the tests hold
the kernels to it.

State layouts (columns per row):

* SGD: none.
* Adagrad: ``dim`` accumulators, or 1 shared accumulator when ``vectorwise_shared``.
* Adam: ``m`` (dim), ``v`` (dim), then the row's step count ``t`` (1). ``t`` is a
  float32, exact up to 2**24 steps of one row, far past where bias correction matters.
"""

from __future__ import annotations

import numpy as np

# The schemas are shared with the user API and the config files; re-exported here for
# the server code that names them next to the kernels.
from persia_py.config.optimizer import (  # noqa: F401 - re-exported
    AdagradConfig,
    AdamConfig,
    OptimizerConfig,
    SGDConfig,
    optimizer_from_dict,
    optimizer_kind,
    optimizer_to_dict,
)


def state_width(cfg: OptimizerConfig, dim: int) -> int:
    """Number of float32 state columns per row for ``cfg`` at embedding width ``dim``."""
    optimizer_kind(cfg)  # ValueError for anything but an optimizer config
    if isinstance(cfg, SGDConfig):
        return 0
    if isinstance(cfg, AdagradConfig):
        return 1 if cfg.vectorwise_shared else dim
    return 2 * dim + 1


def initial_state(cfg: OptimizerConfig, n: int, dim: int) -> np.ndarray:
    """Fresh state for ``n`` new rows, shape ``(n, state_width(cfg, dim))``, float32."""
    width = state_width(cfg, dim)
    if isinstance(cfg, AdagradConfig):
        return np.full((n, width), cfg.initial_accumulator_value, dtype=np.float32)
    return np.zeros((n, width), dtype=np.float32)


def apply_update(cfg: OptimizerConfig, weights: np.ndarray, state: np.ndarray,
                 grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One optimizer step on gathered rows; returns ``(new_weights, new_state)``.

    Each row's gradient must already be the sum over every occurrence of its id in
    the batch: the stateful optimizers are not linear in the gradient.
    """
    optimizer_kind(cfg)  # ValueError for anything but an optimizer config
    w = np.asarray(weights, dtype=np.float32)
    g = np.asarray(grads, dtype=np.float32)
    if cfg.weight_decay:
        g = g + np.float32(cfg.weight_decay) * w
    if isinstance(cfg, SGDConfig):
        return w - np.float32(cfg.lr) * g, np.asarray(state, dtype=np.float32).copy()
    if isinstance(cfg, AdagradConfig):
        return _adagrad(cfg, w, np.asarray(state, dtype=np.float32), g)
    return _adam(cfg, w, np.asarray(state, dtype=np.float32), g)


def _adagrad(cfg: AdagradConfig, w: np.ndarray, acc: np.ndarray,
             g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    g2 = g * g
    if cfg.vectorwise_shared:
        g2 = g2.mean(axis=1, keepdims=True)
    acc = np.float32(cfg.g_square_momentum) * acc + g2
    step = np.float32(cfg.lr) * g / (np.sqrt(acc) + np.float32(cfg.eps))
    return w - step, acc


def _adam(cfg: AdamConfig, w: np.ndarray, state: np.ndarray,
          g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    dim = w.shape[1]
    b1, b2 = cfg.betas
    m = np.float32(b1) * state[:, :dim] + np.float32(1.0 - b1) * g
    v = np.float32(b2) * state[:, dim:2 * dim] + np.float32(1.0 - b2) * (g * g)
    t = state[:, 2 * dim:] + np.float32(1.0)
    # Bias corrections in float64: 1 - b2**t is tiny for small t and loses digits in f32.
    t64 = t.astype(np.float64)
    m_hat = m / (1.0 - np.power(b1, t64)).astype(np.float32)
    v_hat = v / (1.0 - np.power(b2, t64)).astype(np.float32)
    new_w = w - np.float32(cfg.lr) * m_hat / (np.sqrt(v_hat) + np.float32(cfg.eps))
    return new_w, np.concatenate([m, v, t], axis=1)

"""Row-wise embedding optimizers on the servers: state layout and the vectorized update.

The hyper-parameter schemas (``SGDConfig``, ``AdagradConfig``, ``AdamConfig``) live in
:mod:`persia_py.config.optimizer`, shared with the user API and the config files.

Optimizer state lives next to the weights as extra float32 columns per row, so the
table can update weights and state with the same row numbers. The table runs the fused
in-place kernels of :mod:`persia_py.servers.kernels`; ``apply_update`` is their numpy
reference (pure: it works on gathered rows and returns new arrays), and the tests hold
the kernels to it.

Each optimizer is one :class:`OptimizerRule` registered in :data:`OPTIMIZERS` under the
wire name of its schema: its state layout, its numpy reference and its kernel binding;
everything here and in :mod:`persia_py.servers.row_step` looks the rule up there.

State layouts (columns per row):

* SGD: none.
* Adagrad: ``dim`` accumulators, or 1 shared accumulator when ``vectorwise_shared``.
* Adam: ``m`` (dim), ``v`` (dim), then the row's step count ``t`` (1). ``t`` is a
  float32, exact up to 2**24 steps of one row, far past where bias correction matters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

# The schemas are shared with the user API and the config files; re-exported here for
# the server code that names them next to the kernels.
from persia_py.config.optimizer import (  # noqa: F401 - re-exported
    OPTIMIZER_TYPES,
    AdagradConfig,
    AdamConfig,
    OptimizerConfig,
    SGDConfig,
    optimizer_from_dict,
    optimizer_kind,
    optimizer_to_dict,
)
from persia_py.config.registry import Registry
from persia_py.servers import kernels

StepKernel = Callable[..., int]
"""A table's step bound to its hyper-parameters: ``step(weights, state, rows, grads,
stamps, tick, ids, sr_key, stochastic)`` steps ``weights[rows]`` (as
:func:`row_types.kernel_view` gives them) and ``state[rows]`` in place, as
:func:`kernels.sgd_step` says, and returns the number of rows stepped."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelStep:
    """The :data:`StepKernel` of a built-in optimizer: :func:`kernels.sgd_step` (``kind``
    ``kernels.SGD``) or :func:`kernels.adaptive_step` with these hyper-parameters, in the
    kernels' types. Its fields are what a step over many tables in one kernel call takes
    per table (:mod:`persia_py.servers.request_tables`)."""

    kind: int
    lr: np.float32
    weight_decay: np.float32
    bound: np.float32
    eps: np.float32 = np.float32(0.0)
    momentum: np.float32 = np.float32(0.0)
    beta1: float = 0.0
    beta2: float = 0.0

    def __call__(self, weights: np.ndarray, state: np.ndarray, rows: np.ndarray,
                 grads: np.ndarray, stamps: np.ndarray, tick: int, ids: np.ndarray,
                 sr_key: np.uint64, stochastic: bool) -> int:
        if self.kind == kernels.SGD:
            return kernels.sgd_step(weights, rows, grads, stamps, tick, ids, sr_key,
                                    stochastic, self.lr, self.weight_decay, self.bound)
        return kernels.adaptive_step(self.kind, weights, state, rows, grads, stamps, tick,
                                     ids, sr_key, stochastic, self.lr, self.weight_decay,
                                     self.bound, self.eps, self.momentum, self.beta1,
                                     self.beta2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerRule:
    """How the parameter servers apply one optimizer. Each callable takes the optimizer's
    config (an instance of ``schema``) first."""

    schema: type
    """Its hyper-parameters, registered under the same name in
    :data:`persia_py.config.optimizer.OPTIMIZER_TYPES`."""
    state_width: Callable[[Any, int], int]
    """``(cfg, dim)`` -> float32 state columns per row at embedding width ``dim``."""
    initial_value: Callable[[Any], float]
    """``cfg`` -> the value of every state column of a new row."""
    reference: Callable[[Any, np.ndarray, np.ndarray, np.ndarray],
                        tuple[np.ndarray, np.ndarray]]
    """``(cfg, w, state, g)`` -> ``(new_w, new_state)``: the numpy reference of one step
    on gathered float32 rows, ``g`` with the weight decay added; pure (new arrays)."""
    kernel: Callable[[Any, np.float32], StepKernel]
    """``(cfg, weight_bound)`` -> the fused in-place step of :mod:`kernels`, with the
    hyper-parameters converted to the kernel's types once (per table, not per call)."""


OPTIMIZERS: Registry[OptimizerRule] = Registry("optimizer")
"""Wire name -> the servers' rule; every name also names a schema in ``OPTIMIZER_TYPES``."""


def register_optimizer(name: str, rule: OptimizerRule) -> OptimizerRule:
    """Register ``rule`` as optimizer ``name``, whose schema must be ``rule.schema``."""
    if OPTIMIZER_TYPES[name] is not rule.schema:
        raise ValueError(f"optimizer {name!r}: its schema is {OPTIMIZER_TYPES[name].__name__}, "
                         f"the rule's {rule.schema.__name__}")
    return OPTIMIZERS.register(name, rule)


def rule_of(cfg: OptimizerConfig) -> OptimizerRule:
    """The rule of ``cfg``'s optimizer; ValueError for anything but an optimizer config,
    or one of a schema the servers have no rule for."""
    name = optimizer_kind(cfg)
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} has a schema but no rule on the parameter "
                         f"servers, which apply {OPTIMIZERS.names()} "
                         "(register one in persia_py.servers.optimizers)")
    return OPTIMIZERS[name]


def state_width(cfg: OptimizerConfig, dim: int) -> int:
    """Number of float32 state columns per row for ``cfg`` at embedding width ``dim``."""
    return rule_of(cfg).state_width(cfg, dim)


def initial_state(cfg: OptimizerConfig, n: int, dim: int) -> np.ndarray:
    """Fresh state for ``n`` new rows, shape ``(n, state_width(cfg, dim))``, float32."""
    rule = rule_of(cfg)
    return np.full((n, rule.state_width(cfg, dim)), rule.initial_value(cfg), dtype=np.float32)


def apply_update(cfg: OptimizerConfig, weights: np.ndarray, state: np.ndarray,
                 grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One optimizer step on gathered rows; returns ``(new_weights, new_state)``.

    Each row's gradient must already be the sum over every occurrence of its id in
    the batch: the stateful optimizers are not linear in the gradient.
    """
    rule = rule_of(cfg)
    w = np.asarray(weights, dtype=np.float32)
    g = np.asarray(grads, dtype=np.float32)
    if cfg.weight_decay:
        g = g + np.float32(cfg.weight_decay) * w
    return rule.reference(cfg, w, np.asarray(state, dtype=np.float32), g)


def step_kernel(cfg: OptimizerConfig, weight_bound: float | None) -> StepKernel:
    """``cfg``'s fused step with every weight clamped to ``[-weight_bound, weight_bound]``
    (None: unbounded)."""
    return rule_of(cfg).kernel(cfg, np.float32(np.inf if weight_bound is None else weight_bound))


# -- SGD -------------------------------------------------------------------------------------


def _sgd(cfg: SGDConfig, w: np.ndarray, state: np.ndarray,
         g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return w - np.float32(cfg.lr) * g, state.copy()


def _sgd_kernel(cfg: SGDConfig, bound: np.float32) -> KernelStep:
    return KernelStep(kind=kernels.SGD, lr=np.float32(cfg.lr),
                      weight_decay=np.float32(cfg.weight_decay), bound=bound)


register_optimizer("sgd", OptimizerRule(
    schema=SGDConfig, state_width=lambda cfg, dim: 0, initial_value=lambda cfg: 0.0,
    reference=_sgd, kernel=_sgd_kernel))


# -- Adagrad and Adam: one kernel, kernels.adaptive_step -------------------------------------


def _adaptive_kernel(kind: int, cfg: OptimizerConfig, bound: np.float32, eps: np.float32,
                     momentum: np.float32, beta1: float, beta2: float) -> KernelStep:
    """:func:`kernels.adaptive_step` of ``kind`` with these hyper-parameters."""
    return KernelStep(kind=kind, lr=np.float32(cfg.lr),
                      weight_decay=np.float32(cfg.weight_decay), bound=bound, eps=eps,
                      momentum=momentum, beta1=beta1, beta2=beta2)


def _adagrad(cfg: AdagradConfig, w: np.ndarray, acc: np.ndarray,
             g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    g2 = g * g
    if cfg.vectorwise_shared:
        g2 = g2.mean(axis=1, keepdims=True)
    acc = np.float32(cfg.g_square_momentum) * acc + g2
    step = np.float32(cfg.lr) * g / (np.sqrt(acc) + np.float32(cfg.eps))
    return w - step, acc


register_optimizer("adagrad", OptimizerRule(
    schema=AdagradConfig,
    state_width=lambda cfg, dim: 1 if cfg.vectorwise_shared else dim,
    initial_value=lambda cfg: cfg.initial_accumulator_value,
    reference=_adagrad,
    kernel=lambda cfg, bound: _adaptive_kernel(
        kernels.ADAGRAD, cfg, bound, np.float32(cfg.eps), np.float32(cfg.g_square_momentum),
        0.0, 0.0)))


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


register_optimizer("adam", OptimizerRule(
    schema=AdamConfig, state_width=lambda cfg, dim: 2 * dim + 1, initial_value=lambda cfg: 0.0,
    reference=_adam,
    kernel=lambda cfg, bound: _adaptive_kernel(
        kernels.ADAM, cfg, bound, np.float32(cfg.eps), np.float32(0.0),
        float(cfg.betas[0]), float(cfg.betas[1]))))

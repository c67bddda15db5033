"""Row-wise embedding optimizers: configs, state layout and the vectorized update.

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

import dataclasses
import math
from typing import Any

import numpy as np


def _number(cfg: object, name: str, *, low: float, low_open: bool = False,
            high: float = math.inf, high_open: bool = False) -> None:
    """Coerce field ``name`` to float and check it lies in the given interval."""
    raw = getattr(cfg, name)
    is_number = isinstance(raw, (int, float)) and not isinstance(raw, bool)
    value = float(raw) if is_number else math.nan
    ok = math.isfinite(value) and (value > low if low_open else value >= low) and (
        value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be a finite number in {interval}, got {raw!r}")
    object.__setattr__(cfg, name, value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGDConfig:
    """Plain SGD with L2 weight decay: ``w -= lr * (g + weight_decay * w)``."""

    lr: float
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _number(self, "lr", low=0.0)
        _number(self, "weight_decay", low=0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdagradConfig:
    """Adagrad; ``g_square_momentum < 1`` decays the accumulator (RMSProp-like)."""

    lr: float = 1e-2
    initial_accumulator_value: float = 1e-2
    eps: float = 1e-10
    weight_decay: float = 0.0
    g_square_momentum: float = 1.0
    vectorwise_shared: bool = False

    def __post_init__(self) -> None:
        _number(self, "lr", low=0.0)
        _number(self, "initial_accumulator_value", low=0.0)
        _number(self, "eps", low=0.0, low_open=True)
        _number(self, "weight_decay", low=0.0)
        _number(self, "g_square_momentum", low=0.0, low_open=True, high=1.0)
        if type(self.vectorwise_shared) is not bool:
            raise ValueError(
                f"vectorwise_shared must be True or False, got {self.vectorwise_shared!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamConfig:
    """Adam with per-row bias correction and L2 weight decay (like torch.optim.Adam)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _number(self, "lr", low=0.0)
        _number(self, "eps", low=0.0, low_open=True)
        _number(self, "weight_decay", low=0.0)
        betas = self.betas
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair of numbers in [0, 1), got {betas!r}")
        checked = []
        for i, beta in enumerate(betas):
            if (isinstance(beta, bool) or not isinstance(beta, (int, float))
                    or not 0.0 <= float(beta) < 1.0):
                raise ValueError(f"betas[{i}] must be a number in [0, 1), got {beta!r}")
            checked.append(float(beta))
        object.__setattr__(self, "betas", tuple(checked))


OptimizerConfig = SGDConfig | AdagradConfig | AdamConfig

_TYPES: dict[str, type] = {"sgd": SGDConfig, "adagrad": AdagradConfig, "adam": AdamConfig}
_NAMES = {cls: name for name, cls in _TYPES.items()}


def _kind(cfg: OptimizerConfig) -> str:
    try:
        return _NAMES[type(cfg)]
    except KeyError:
        raise ValueError(
            f"optimizer must be one of {[c.__name__ for c in _TYPES.values()]}, "
            f"got {type(cfg).__name__}") from None


def state_width(cfg: OptimizerConfig, dim: int) -> int:
    """Number of float32 state columns per row for ``cfg`` at embedding width ``dim``."""
    kind = _kind(cfg)
    if kind == "sgd":
        return 0
    if kind == "adagrad":
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
    kind = _kind(cfg)
    w = np.asarray(weights, dtype=np.float32)
    g = np.asarray(grads, dtype=np.float32)
    if cfg.weight_decay:
        g = g + np.float32(cfg.weight_decay) * w
    if kind == "sgd":
        return w - np.float32(cfg.lr) * g, np.asarray(state, dtype=np.float32).copy()
    if kind == "adagrad":
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


def optimizer_to_dict(cfg: OptimizerConfig) -> dict[str, Any]:
    """``{"type": name, **fields}``, JSON-friendly (``betas`` becomes a list)."""
    out: dict[str, Any] = {"type": _kind(cfg)}
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        out[field.name] = list(value) if isinstance(value, tuple) else value
    return out


def optimizer_from_dict(d: dict[str, Any]) -> OptimizerConfig:
    """Inverse of :func:`optimizer_to_dict`; rejects unknown types and keys."""
    kind = d.get("type") if hasattr(d, "get") else None
    if kind not in _TYPES:
        raise ValueError(
            f"optimizer config needs a 'type' in {sorted(_TYPES)}, got {d!r}")
    cls = _TYPES[kind]
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(allowed) - {"type"})
    if unknown:
        raise ValueError(
            f"unknown key(s) {unknown} for optimizer type {kind!r}; allowed: {allowed}")
    try:
        return cls(**{k: v for k, v in d.items() if k != "type"})
    except TypeError as err:  # a required field is missing
        raise ValueError(
            f"bad fields for optimizer type {kind!r} (allowed: {allowed}): {err}") from None

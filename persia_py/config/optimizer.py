"""Embedding optimizer hyper-parameters: the one schema, defaults and validation.

Used by the user classes (:mod:`persia_py.embedding.optim`), the config files
(``slots_config.<slot>.optimizer``) and the parameter servers, which apply them
(:mod:`persia_py.servers.optimizers`). On the wire an optimizer is the dict of
:func:`optimizer_to_dict`: ``{"type": name, **fields}``, ``name`` one registered in
:data:`OPTIMIZER_TYPES` (``sgd``, ``adagrad``, ``adam``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, TypeVar

from persia_py.config.checks import check_number
from persia_py.config.registry import Registry

_Schema = TypeVar("_Schema", bound=type)


class OptimizerConfig(Protocol):
    """What every optimizer schema has (a frozen keyword-only dataclass): the fields the
    servers apply to every optimizer, before its own rule."""

    __dataclass_fields__: ClassVar[dict[str, Any]]
    @property
    def lr(self) -> float: ...
    @property
    def weight_decay(self) -> float: ...


OPTIMIZER_TYPES: Registry[type] = Registry("optimizer")
"""Wire name -> schema: an optimizer's hyper-parameters are added by registering its
schema with :func:`optimizer_schema`; the servers' rule for it is registered in
:mod:`persia_py.servers.optimizers` under the same name."""


def optimizer_schema(name: str) -> Callable[[_Schema], _Schema]:
    """Class decorator: register the schema under the wire name ``name``."""
    def register(cls: _Schema) -> _Schema:
        OPTIMIZER_TYPES.register(name, cls)
        return cls
    return register


def _number(cfg: object, name: str, **interval: Any) -> None:
    """Store field ``name`` of the frozen ``cfg`` as a float checked to lie in ``interval``."""
    object.__setattr__(cfg, name, check_number(name, getattr(cfg, name), **interval))


@optimizer_schema("sgd")
@dataclasses.dataclass(frozen=True, kw_only=True)
class SGDConfig:
    """Plain SGD with L2 weight decay: ``w -= lr * (g + weight_decay * w)``."""

    lr: float
    """Learning rate (required), >= 0."""
    weight_decay: float = 0.0
    """L2 penalty added to the gradient, >= 0."""

    def __post_init__(self) -> None:
        _number(self, "lr", low=0.0)
        _number(self, "weight_decay", low=0.0)


@optimizer_schema("adagrad")
@dataclasses.dataclass(frozen=True, kw_only=True)
class AdagradConfig:
    """Adagrad with PERSIA's hyper-parameters and torch.optim.Adagrad's update and
    defaults: ``acc = g_square_momentum * acc + g**2``, then ``w -= lr * g / (sqrt(acc) +
    eps)``; ``g_square_momentum < 1`` decays the accumulator (RMSProp-like)."""

    lr: float = 1e-2
    """Learning rate, >= 0."""
    initial_accumulator_value: float = 0.0
    """Value of a new row's accumulator, >= 0. torch's 0: the accumulator takes ``g**2``
    before the step, so a row's first step is ``lr * sign(g)``. PERSIA's 0.01 suits its
    update, which divides by the accumulator as it was before the step; here it holds
    every early step of a small gradient (``|g|`` well under 0.1, as an embedding's share
    of a mean loss is) to about ``10 * lr * |g|``, and a model can stay near chance."""
    eps: float = 1e-10
    """Added to the accumulator's square root, > 0."""
    weight_decay: float = 0.0
    """L2 penalty added to the gradient, >= 0."""
    g_square_momentum: float = 1.0
    """Factor on the accumulator before each squared gradient is added, in (0, 1]."""
    vectorwise_shared: bool = False
    """One accumulator per row (the mean squared gradient) instead of one per column."""

    def __post_init__(self) -> None:
        _number(self, "lr", low=0.0)
        _number(self, "initial_accumulator_value", low=0.0)
        _number(self, "eps", low=0.0, low_open=True)
        _number(self, "weight_decay", low=0.0)
        _number(self, "g_square_momentum", low=0.0, low_open=True, high=1.0)
        if type(self.vectorwise_shared) is not bool:
            raise ValueError(
                f"vectorwise_shared: expected True or False, got {self.vectorwise_shared!r}")


@optimizer_schema("adam")
@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamConfig:
    """Adam with per-row bias correction and L2 weight decay (like torch.optim.Adam)."""

    lr: float = 1e-3
    """Learning rate, >= 0."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Decay of the first and second moment estimates, each in [0, 1)."""
    eps: float = 1e-8
    """Added to the second moment's square root, > 0."""
    weight_decay: float = 0.0
    """L2 penalty added to the gradient, >= 0."""

    def __post_init__(self) -> None:
        _number(self, "lr", low=0.0)
        _number(self, "eps", low=0.0, low_open=True)
        _number(self, "weight_decay", low=0.0)
        betas = self.betas
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas: expected a pair of numbers in [0, 1), got {betas!r}")
        checked = tuple(check_number(f"betas[{i}]", beta, low=0.0, high=1.0, high_open=True)
                        for i, beta in enumerate(betas))
        object.__setattr__(self, "betas", checked)


def optimizer_kind(cfg: OptimizerConfig) -> str:
    """The wire name of ``cfg``'s type; ValueError for anything but an optimizer config."""
    for name, cls in OPTIMIZER_TYPES.items():
        if type(cfg) is cls:
            return name
    raise ValueError(
        f"optimizer must be one of {[c.__name__ for _, c in OPTIMIZER_TYPES.items()]}, "
        f"got {type(cfg).__name__}")


def optimizer_to_dict(cfg: OptimizerConfig) -> dict[str, Any]:
    """``{"type": name, **fields}``, JSON-friendly (``betas`` becomes a list)."""
    out: dict[str, Any] = {"type": optimizer_kind(cfg)}
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        out[field.name] = list(value) if isinstance(value, tuple) else value
    return out


def optimizer_from_dict(d: dict[str, Any]) -> OptimizerConfig:
    """Inverse of :func:`optimizer_to_dict`; rejects unknown types and keys."""
    kind = d.get("type") if hasattr(d, "get") else None
    if kind not in OPTIMIZER_TYPES:
        raise ValueError(
            f"optimizer config needs a 'type' in {sorted(OPTIMIZER_TYPES)}, got {d!r}")
    cls = OPTIMIZER_TYPES[kind]
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


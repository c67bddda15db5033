"""Embedding optimizers, applied on the parameter servers (as PERSIA's ``persia.embedding.optim``).

Each class takes PERSIA's arguments in PERSIA's order and checks them at once, against
the one schema the servers use (:mod:`persia_py.config.optimizer`, where the defaults
are declared): every hyper-parameter is honoured or rejected, never ignored.
"""

from __future__ import annotations

from typing import Any

from persia_py.config.optimizer import (
    AdagradConfig,
    AdamConfig,
    OptimizerConfig,
    SGDConfig,
    optimizer_to_dict,
)

__all__ = ["Adagrad", "Adam", "Optimizer", "SGD"]


class Optimizer:
    """Base of the embedding optimizers: a checked optimizer config."""

    def __init__(self, config: OptimizerConfig) -> None:
        self.config = config

    def to_dict(self) -> dict[str, Any]:
        """The form sent to the servers: ``{"type": kind, **hyper-parameters}``."""
        return optimizer_to_dict(self.config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items() if k != "type")
        return f"{type(self).__name__}({args})"


class SGD(Optimizer):
    """Plain SGD with optional L2 weight decay."""

    def __init__(self, lr: float, weight_decay: float = SGDConfig.weight_decay) -> None:
        super().__init__(SGDConfig(lr=lr, weight_decay=weight_decay))


class Adagrad(Optimizer):
    """Adagrad with PERSIA's hyper-parameters and torch.optim.Adagrad's update and defaults
    (``initial_accumulator_value=0``; ``vectorwise_shared``: one accumulator per row)."""

    def __init__(
        self,
        lr: float = AdagradConfig.lr,
        initial_accumulator_value: float = AdagradConfig.initial_accumulator_value,
        weight_decay: float = AdagradConfig.weight_decay,
        g_square_momentum: float = AdagradConfig.g_square_momentum,
        eps: float = AdagradConfig.eps,
        vectorwise_shared: bool = AdagradConfig.vectorwise_shared,
    ) -> None:
        super().__init__(AdagradConfig(
            lr=lr, initial_accumulator_value=initial_accumulator_value,
            weight_decay=weight_decay, g_square_momentum=g_square_momentum, eps=eps,
            vectorwise_shared=vectorwise_shared,
        ))


class Adam(Optimizer):
    """Adam with per-row bias correction."""

    def __init__(
        self,
        lr: float = AdamConfig.lr,
        betas: tuple[float, float] = AdamConfig.betas,
        weight_decay: float = AdamConfig.weight_decay,
        eps: float = AdamConfig.eps,
    ) -> None:
        super().__init__(AdamConfig(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps))

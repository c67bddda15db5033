"""Embedding optimizers, applied on the parameter servers (as PERSIA's ``persia.embedding.optim``).

These objects only carry hyper-parameters; the servers validate and apply them. Every
hyper-parameter is honoured or rejected, never ignored.
"""

from __future__ import annotations

from typing import Any


class Optimizer:
    """Base of the embedding optimizers."""

    def __init__(self, kind: str, **hyper: Any) -> None:
        self.kind = kind
        self.hyper = hyper

    def to_dict(self) -> dict[str, Any]:
        """The form sent to the servers: ``{"type": kind, **hyper-parameters}``."""
        return {"type": self.kind, **self.hyper}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyper.items())
        return f"{type(self).__name__}({args})"


class SGD(Optimizer):
    """Plain SGD with optional L2 weight decay."""

    def __init__(self, lr: float, weight_decay: float = 0.0) -> None:
        super().__init__("sgd", lr=lr, weight_decay=weight_decay)


class Adagrad(Optimizer):
    """Adagrad with PERSIA's hyper-parameters (``vectorwise_shared``: one accumulator per row)."""

    def __init__(
        self,
        lr: float = 1e-2,
        initial_accumulator_value: float = 1e-2,
        weight_decay: float = 0.0,
        g_square_momentum: float = 1.0,
        eps: float = 1e-10,
        vectorwise_shared: bool = False,
    ) -> None:
        super().__init__(
            "adagrad", lr=lr, initial_accumulator_value=initial_accumulator_value,
            weight_decay=weight_decay, g_square_momentum=g_square_momentum, eps=eps,
            vectorwise_shared=vectorwise_shared,
        )


class Adam(Optimizer):
    """Adam with per-row bias correction."""

    def __init__(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
    ) -> None:
        super().__init__("adam", lr=lr, betas=list(betas), weight_decay=weight_decay, eps=eps)

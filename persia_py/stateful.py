"""The state interface between a training context and whoever saves it (checkpoints).

As ``torch.distributed.checkpoint`` and torchtitan's ``CheckpointManager``: a saver sees
only :class:`Stateful` objects (a torch module and optimizer are ones already), never
the context's internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """Something whose state can be read out and put back."""

    def state_dict(self) -> dict[str, Any]:
        """The state, as a mapping."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`."""
        ...


@dataclass
class TrainState:
    """Progress of one NN-worker rank: the batches it has trained, including those
    before the checkpoint it resumed from (its data position)."""

    steps: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        steps = state_dict["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"train_state.steps: expected an int >= 0, got {steps!r}")
        self.steps = steps

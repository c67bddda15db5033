"""The state interface between a training context and whoever saves it (checkpoints).

As ``torch.distributed.checkpoint`` and torchtitan's ``CheckpointManager``: a saver sees
only :class:`Stateful` objects (a torch module and optimizer are ones already), never
the context's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from persia_py.data_position import DataPositions


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
    before the checkpoint it resumed from, and the data positions (every loader's
    batches trained by all ranks, :mod:`persia_py.data_position`) as of the last
    checkpoint written or loaded, plus the data-loader batches this rank trained since."""

    steps: int = 0
    positions: DataPositions = field(default_factory=DataPositions)
    new_batch_ids: list[int] = field(default_factory=list)

    def trained(self, batch_id: int | None) -> None:
        """Count one trained batch (``batch_id``: a data loader's; None: made in-process)."""
        self.steps += 1
        if batch_id is not None:
            self.new_batch_ids.append(batch_id)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "data_positions": self.positions.to_json(),
                "new_batch_ids": list(self.new_batch_ids)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``steps`` and ``data_positions`` (a checkpoint's cut: no batch trained
        since; ``new_batch_ids`` is not read)."""
        steps = state_dict["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"train_state.steps: expected an int >= 0, got {steps!r}")
        positions = DataPositions.from_json(state_dict.get("data_positions", {}),
                                            "train_state.data_positions")
        self.steps, self.positions, self.new_batch_ids = steps, positions, []

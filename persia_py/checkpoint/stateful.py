"""The state interface between a training context and whoever saves it (checkpoints).

As ``torch.distributed.checkpoint`` and torchtitan's ``CheckpointManager``: a saver sees
only :class:`Stateful` objects (a torch module and optimizer are ones already), never
the context's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from persia_py.ids.positions import DataPositions


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
    """Progress of one NN-worker rank: the batches and samples it has trained, including
    those before the checkpoint it resumed from; the job's step; and the data positions
    (every loader's batches trained by all ranks, :mod:`persia_py.ids.positions`) as of
    the last checkpoint written or loaded, plus the data-loader batches this rank trained
    since."""

    steps: int = 0
    positions: DataPositions = field(default_factory=DataPositions)
    new_batch_ids: list[int] = field(default_factory=list)
    job_step: int = 0
    """Training steps of the job, the same count on every rank: 1-based, the step just
    done. A rank counts its own and, out of batches (``Join``), the others'; a resumed
    job goes on from its checkpoint's. The training log's ``step``, and what periodic
    checkpoints and progressive-validation windows are counted in."""
    samples: int = 0
    """Samples this rank has trained, counting those before a resumed checkpoint."""

    def trained(self, batch_id: int | None, batch_size: int = 0) -> None:
        """Count one trained batch (``batch_id``: a data loader's; None: made in-process)."""
        self.steps += 1
        self.job_step += 1
        self.samples += batch_size
        if batch_id is not None:
            self.new_batch_ids.append(batch_id)

    def shadowed(self) -> None:
        """Count a step the other ranks took while this one, out of batches, joined it."""
        self.job_step += 1

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "data_positions": self.positions.to_json(),
                "new_batch_ids": list(self.new_batch_ids), "job_step": self.job_step,
                "samples": self.samples}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``steps``, ``data_positions`` and, when given, ``job_step`` and
        ``samples`` (a checkpoint's cut: no batch trained since; ``new_batch_ids`` is not
        read)."""
        counts = {key: state_dict.get(key, getattr(self, key))
                  for key in ("steps", "job_step", "samples")}
        counts["steps"] = state_dict["steps"]
        for key, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"train_state.{key}: expected an int >= 0, got {value!r}")
        positions = DataPositions.from_json(state_dict.get("data_positions", {}),
                                            "train_state.data_positions")
        self.steps, self.job_step, self.samples = (counts["steps"], counts["job_step"],
                                                   counts["samples"])
        self.positions, self.new_batch_ids = positions, []

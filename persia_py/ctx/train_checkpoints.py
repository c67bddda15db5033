"""``CheckpointedCtx``: the checkpoint methods of :class:`persia_py.ctx.TrainCtx`.

A training rank's part of a checkpoint is its dense model, dense optimizer and
:class:`~persia_py.checkpoint.stateful.TrainState`, as ``torch.distributed.checkpoint``
takes them (:meth:`CheckpointedCtx.state_dict`); the embeddings live on the servers. The
:class:`~persia_py.checkpoint.coordinator.Checkpointer` that writes and reads them, and the
reporter that logs where training resumed, are built when the context is entered.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import torch

from persia_py.checkpoint.coordinator import Checkpointer
from persia_py.checkpoint.stateful import Stateful, TrainState
from persia_py.checkpoint.torchscript import torchscript, torchscript_sharded
from persia_py.ctx.embedding_ctx import EmbeddingCtx
from persia_py.distributed import DenseParallel
from persia_py.ops.safe_files import check_name
from persia_py.progressive import ProgressiveValidation
from persia_py.telemetry.progress import StepReporter

_T = TypeVar("_T")


def entered(part: _T | None, what: str) -> _T:
    """``part``, which entering the context builds; RuntimeError naming ``what`` before."""
    if part is None:
        raise RuntimeError(f"{what} is built when the context is entered; use it inside "
                           "`with TrainCtx(...) as ctx:`")
    return part


class CheckpointedCtx(EmbeddingCtx):
    """A context whose rank's training state checkpoints (the base of ``TrainCtx``,
    which sets the attributes declared here)."""

    model: torch.nn.Module  # required here (an EmbeddingCtx may have none)
    dense_optimizer: torch.optim.Optimizer
    dense: DenseParallel
    train_state: TrainState
    progressive: ProgressiveValidation | None
    _checkpointer: Checkpointer | None
    _reporter: StepReporter | None

    @property
    def checkpointer(self) -> Checkpointer:
        """This rank's checkpoint writer and reader (built on entering the context)."""
        return entered(self._checkpointer, "TrainCtx.checkpointer")

    @property
    def reporter(self) -> StepReporter:
        """Progress line, training log and metrics of this rank (built on entering the
        context; see persia_py.telemetry.progress)."""
        return entered(self._reporter, "TrainCtx.reporter")

    def state_dict(self) -> dict[str, Stateful]:
        """This rank's part of a checkpoint, as ``torch.distributed.checkpoint`` takes it:
        ``model`` (the dense model), ``dense_optimizer`` and ``train_state``
        (:class:`~persia_py.checkpoint.stateful.TrainState`), each a Stateful object read and
        restored in place. The embeddings live on the servers (see :meth:`dump_checkpoint`)."""
        return {"model": self.model, "dense_optimizer": self.dense_optimizer,
                "train_state": self.train_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict`'s parts' ``state_dict()`` returned, given as
        plain mappings under the same keys; every key is required."""
        parts = self.state_dict()
        if set(state_dict) != set(parts):
            raise ValueError(f"state_dict: expected the keys {sorted(parts)}, got "
                             f"{sorted(state_dict)}")
        for key, part in parts.items():
            part.load_state_dict(state_dict[key])

    def dump_checkpoint(self, dst_dir: str, *, with_jit_model: bool = False,
                        jit_dense_filename: str = "jit_dense.pt",
                        blocking: bool = True) -> Path | None:
        """Checkpoint embeddings with optimizer state, the dense model and optimizer, and
        the batches trained into ``dst_dir`` (see :mod:`persia_py.checkpoint.coordinator`); every rank
        calls it at the same step. Returns the checkpoint folder on rank 0, else None.

        With ``with_jit_model`` (as PERSIA) the folder also holds the dense model compiled
        by ``torch.jit.script`` as ``jit_dense_filename`` (load it with ``torch.jit.load``);
        a model TorchScript cannot compile is a ``ValueError`` before anything is written.
        Under ``FSDPOption`` the shards are gathered onto rank 0 and a plain copy of the
        whole tower is compiled there, on the CPU (every rank calls this, as always).
        Dumps always block (``blocking=False`` is refused): a checkpoint is a cut that
        every rank waits for.
        """
        if not blocking:
            raise ValueError("blocking=False is not supported: every rank waits for the "
                             "checkpoint's consistent cut; call dump_checkpoint(dst_dir)")
        self._require_active("ctx.dump_checkpoint")
        extra_files = {}
        if with_jit_model:
            check_name(jit_dense_filename, "jit_dense_filename")
            if not jit_dense_filename.endswith(".pt"):
                raise ValueError(f"jit_dense_filename: {jit_dense_filename!r} must end with "
                                 "'.pt'")
            if not self.dense.sharded:
                extra_files[jit_dense_filename] = torchscript(self.model)
            elif (scripted := torchscript_sharded(self.model)) is not None:  # rank 0
                extra_files[jit_dense_filename] = scripted
        return self.checkpointer.dump(dst_dir, extra_files=extra_files)

    def load_checkpoint(self, src_dir: str) -> None:
        """Load a checkpoint written by :meth:`dump_checkpoint` (a root or one folder)."""
        self._require_active("ctx.load_checkpoint")
        self.checkpointer.load(src_dir)
        last_cut = self.checkpointer.last_cut
        assert last_cut is not None and last_cut[1] is not None, "load() sets it"
        self._resumed(last_cut[1])

    def _resumed(self, folder: Path) -> None:
        """The training log and progressive validation count on from a loaded checkpoint."""
        state = self.train_state
        self.reporter.resumed(step=state.job_step, samples=state.samples, checkpoint=str(folder))
        if self.progressive is not None:
            self.progressive.start_at(state.job_step)

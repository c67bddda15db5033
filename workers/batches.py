"""What an NN worker holds of one batch: the looked-up :class:`TrainingBatch`, and the
link to the data loader that made it (:class:`LoaderLink`), which keeps the batch's ID
features until the NN workers say it is done, so that a restarted embedding worker can be
given them again."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch

from persia_py.config import CommonConfig
from persia_py.proto import data_loader_pb2 as pb
from persia_py.wire.rpc import OutageLog, call
from persia_py.workers.slots import SlotRows

__all__ = ["LoaderBatch", "LoaderLink", "TrainingBatch", "ref_gone"]

logger = logging.getLogger(__name__)


@dataclass
class TrainingBatch:
    """A batch ready for ``ctx.forward``: embeddings looked up, tensors built."""

    non_id_type_features: list[torch.Tensor]
    labels: list[torch.Tensor]
    slots: list[SlotRows]
    requires_grad: bool
    batch_size: int
    meta: bytes = b""
    ref: int = 0
    embedding_worker: int = 0
    batch_id: int | None = None
    """The data loader's id of this batch (see persia_py.ids.positions); None when the
    batch was made in this process."""
    staleness: int = 0
    """Batches of this NN worker whose embedding updates were not yet applied when this
    batch's embeddings were looked up."""
    release: Callable[[], None] = field(default=lambda: None)
    """Called once the batch's gradients are acknowledged (or at once without grads)."""
    loader: LoaderLink | None = None
    """The data loader that made it (which keeps its ID features until told it is done)."""

    @property
    def nbytes(self) -> int:
        """Bytes this batch holds now plus the gradients it will produce."""
        rows = sum(s.rows.nbytes for s in self.slots)
        other = sum(s.index.nbytes + s.lengths.nbytes for s in self.slots)
        dense = sum(t.numel() * t.element_size()
                    for t in [*self.non_id_type_features, *self.labels])
        return 2 * rows + other + dense


class LoaderLink:
    """An NN worker's side of one data loader: the batch ids it finished training, told to
    the loader with its next NextBatch (the loader then forgets their ID features), and
    a way to have a batch put on its embedding worker again when that worker restarted
    and lost it (see kept_batches.KeptBatches)."""

    def __init__(self, stub, address: str, common: CommonConfig, outages: OutageLog) -> None:
        self.stub, self.address = stub, address
        self._common, self._outages = common, outages
        self._done: list[int] = []
        self._in_training: set[int] = set()  # batches handed to this worker, not finished
        self._changed = threading.Condition()

    def handed(self, batch_id: int) -> None:
        with self._changed:
            self._in_training.add(batch_id)

    def finished(self, batch_id: int) -> None:
        """The batch's training is over (its update acknowledged, or none was due)."""
        with self._changed:
            self._done.append(batch_id)
            self._in_training.discard(batch_id)
            self._changed.notify_all()

    def _wait_settled(self, timeout: float) -> bool:
        """Whether every batch handed over is finished (waits up to ``timeout``)."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._in_training, timeout)

    def settle(self, stop: threading.Event) -> None:
        """After the end of this loader's stream: tell it which batches finished, until
        none it handed over is in training (it keeps them for a resend until then)."""
        while not stop.is_set():
            settled = self._wait_settled(0.5)
            # Retried while the loader restarts: it keeps what it has not been told.
            if not self._tell(self.take_done(), retry=True) or settled:
                return

    def abandon(self) -> None:
        """Tell the loader it may forget every batch handed over, finished or not (the
        stream is closing: nothing will ask for them again)."""
        with self._changed:
            done = self._done + sorted(self._in_training)
            self._done, self._in_training = [], set()
        self._tell(done)

    def _tell(self, done: list[int], retry: bool = False) -> bool:
        """Send ``done`` alone (a request that takes no batch; telling twice is harmless),
        with ``retry`` until ``rpc_timeout_sec`` passed. Best effort: a loader that
        stopped waiting forgets them anyway. False if the loader did not answer."""
        if not done:
            return True
        request = pb.NextBatchRequest(done=done, only_done=True)
        try:
            if retry:
                call(self.stub.NextBatch, request, timeout=self._common.rpc_timeout_sec,
                     idempotent=True, what=f"data loader {self.address}",
                     outages=self._outages)
            else:
                self.stub.NextBatch(request, timeout=5.0)
        except grpc.RpcError as exc:
            logger.info("data loader %s: finished batches not told (%s)", self.address,
                        exc.code().name)
            return False
        return True

    def take_done(self) -> list[int]:
        with self._changed:
            done, self._done = self._done, []
        return done

    def resend(self, batch_id: int, num_workers: int) -> tuple[int, int]:
        """(embedding worker index, new ref) of ``batch_id`` put again by its loader."""
        logger.warning("batch %d is gone from its embedding worker (restarted); asking data "
                       "loader %s to put it there again", batch_id, self.address)
        # Safe to retry: a repeated put of a pending batch answers the same ref.
        answer = call(self.stub.ResendBatch, pb.ResendBatchRequest(batch_id=batch_id),
                      timeout=self._common.rpc_timeout_sec, idempotent=True,
                      what=f"data loader {self.address}", outages=self._outages)
        if not 0 <= answer.embedding_worker < num_workers:
            raise ValueError(f"data loader {self.address} put batch {batch_id} on embedding "
                             f"worker {answer.embedding_worker}, only {num_workers} known")
        return answer.embedding_worker, answer.ref


@dataclass
class LoaderBatch:
    """A batch as a data loader answered it, and that loader."""

    batch: pb.Batch
    loader: LoaderLink


def ref_gone(exc: BaseException) -> bool:
    """Whether an embedding worker answered that it does not hold the ref (it restarted)."""
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.NOT_FOUND

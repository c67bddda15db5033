"""The ID features of the training batches a data loader put on embedding workers, kept
until the NN workers have trained them, for a resend to a restarted embedding worker."""

from __future__ import annotations

import threading

from persia_py.embedding.data import PersiaBatch
from persia_py.wire.rpc import NotFound, Overloaded


class KeptBatches:
    """The ID features of the training batches this loader put on embedding workers, kept
    until the NN worker that trained a batch says it is done (``NextBatchRequest.done``):
    when an embedding worker dies with batches still waiting there, or with their
    updates not yet sent, the NN worker asks for the batch again (``ResendBatch``) and
    the loader puts it on the worker's restarted successor under the same identity.
    At most the batches queued here and those in flight on the NN workers are kept."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._kept: dict[int, tuple[int, PersiaBatch] | None] = {}
        self.num_resent = 0

    def expect(self, batch_ids) -> None:
        """After a restart: these batches are in training; their ID features come back
        when the script makes them again (a resend asked for meanwhile waits)."""
        with self._lock:
            self._kept.update(dict.fromkeys(batch_ids))

    def keep(self, batch_id_: int, worker_index: int, batch: PersiaBatch, *,
             expected: bool = False) -> None:
        """Keep a batch; ``expected``: one made again after a restart, kept only if no NN
        worker said it finished meanwhile."""
        with self._lock:
            if not expected or batch_id_ in self._kept:
                self._kept[batch_id_] = (worker_index, batch)

    def done(self, batch_ids) -> None:
        with self._lock:
            for b in batch_ids:  # a handful per request: those acknowledged since the last
                self._kept.pop(b, None)
            self._lock.notify_all()

    def wait_empty(self, timeout: float) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: not self._kept, timeout)

    def get(self, batch_id_: int) -> tuple[int, PersiaBatch]:
        with self._lock:
            known = batch_id_ in self._kept
            found = self._kept.get(batch_id_)
            if found is not None:
                self.num_resent += 1
        if known and found is None:
            raise Overloaded(f"batch {batch_id_} is being made again (this data loader "
                             "restarted); retry")
        if found is None:
            raise NotFound(f"batch {batch_id_} is not kept by this data loader (done, not "
                           "made by it, or made before it restarted)")
        return found

    def __len__(self) -> int:
        return len(self._kept)

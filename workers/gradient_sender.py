"""Sending a training step's embedding gradients in the background (see
:class:`GradientSender`)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import numpy as np

from persia_py.workers.batches import TrainingBatch, ref_gone
from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient

__all__ = ["GradientSender"]

logger = logging.getLogger(__name__)


class GradientSender:
    """Sends embedding gradients in the background; the first failure is raised on the next call."""

    def __init__(self, workers: list[EmbeddingWorkerClient], max_in_flight: int) -> None:
        self._workers = workers
        self._pool = ThreadPoolExecutor(max_workers=max(1, max_in_flight),
                                        thread_name_prefix="grad-send")
        self._futures: set[Future] = set()
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def submit(self, batch: TrainingBatch, grads: list[tuple[str, np.ndarray]]) -> None:
        self.raise_if_failed()
        future = self._pool.submit(self._send, batch, grads)
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._done)

    def _send(self, batch: TrainingBatch, grads: list[tuple[str, np.ndarray]]) -> None:
        try:
            try:
                self._workers[batch.embedding_worker].update_gradients(batch.ref, grads)
            except grpc.RpcError as exc:
                if batch.loader is None or batch.batch_id is None or not ref_gone(exc):
                    raise
                # Its worker restarted after the lookup: routed again from the loader's
                # copy; replicas that applied it before acknowledge it only.
                index, ref = batch.loader.resend(batch.batch_id, len(self._workers))
                self._workers[index].update_gradients(ref, grads, rerouted=True)
        finally:
            batch.release()

    def _done(self, future: Future) -> None:
        with self._lock:
            self._futures.discard(future)
            if future.exception() is not None and self._error is None:
                self._error = future.exception()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"sending embedding gradients failed: {self._error}") from self._error

    def flush(self, timeout: float) -> None:
        """Wait until every submitted update is acknowledged."""
        with self._lock:
            pending = list(self._futures)
        for f in pending:
            f.exception(timeout=timeout)
        self.raise_if_failed()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

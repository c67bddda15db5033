"""The data-loader runtime: ``DataCtx().send_data(batch)`` and the service NN workers pull from.

``send_data`` stores the batch's ID features on an embedding worker (round robin), then
queues the rest (dense features, labels, the embedding worker's ref) for the NN workers.
Both steps wait when the other side is full: nothing is dropped. On exit, the context
waits until every NN-worker rank has been told the stream ended.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time

import grpc

from persia_py import codec
from persia_py.config import GlobalConfig, load_global_config
from persia_py.data_position import batch_id
from persia_py.embedding.data import PersiaBatch
from persia_py.env import ENV_EMBEDDING_WORKER_ADDRS, PersiaEnv
from persia_py.monitoring import DataLoaderMetrics, MetricsServer, metrics_port_from_env, serve_metrics
from persia_py.proto import common_pb2, data_loader_pb2_grpc
from persia_py.proto import data_loader_pb2 as pb
from persia_py.rpc import create_server, grpc_method
from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient

logger = logging.getLogger(__name__)

_POLL_SEC = 0.5
"""How long NextBatch holds a request open waiting for a batch (long poll)."""


class BatchQueue:
    """Batches waiting for NN workers, and which ranks have seen the end of the stream.

    ``next`` answers a repeated request (same consumer and request sequence) with the
    answer the first one got: a reply lost on the wire is asked for again and loses no
    batch. A rank's requests are answered one at a time, so a retry that arrives while
    the first attempt is still waiting for a batch gets that attempt's answer."""

    _MAX_CONSUMER_BYTES = 64

    def __init__(self, maxsize: int, num_consumers: int) -> None:
        self._queue: queue.Queue[pb.Batch] = queue.Queue(maxsize=maxsize)
        self._finished = threading.Event()
        self._ended_ranks: set[int] = set()
        self._all_ended = threading.Event()
        self.num_consumers = num_consumers
        self._lock = threading.Lock()
        self._rank_locks = [threading.Lock() for _ in range(num_consumers)]
        self._last: dict[int, tuple[bytes, int, pb.NextBatchResponse]] = {}
        self.num_repeated = 0
        """Answers given again to a retried request."""

    def put(self, batch: pb.Batch, timeout: float | None = None) -> None:
        self._queue.put(batch, timeout=timeout)

    def finish(self) -> None:
        self._finished.set()

    def next(self, rank: int, wait: float, consumer: bytes = b"",
             request_seq: int = 0) -> pb.NextBatchResponse:
        if not 0 <= rank < self.num_consumers:
            raise ValueError(f"rank {rank} not in [0, {self.num_consumers})")
        if len(consumer) > self._MAX_CONSUMER_BYTES:
            raise ValueError(f"consumer: {len(consumer)} bytes, at most "
                             f"{self._MAX_CONSUMER_BYTES}")
        with self._rank_locks[rank]:
            last = self._last.get(rank) if consumer else None  # no consumer: no retries
            if last is not None and last[:2] == (consumer, request_seq):
                self.num_repeated += 1
                return last[2]
            answer = self._answer(rank, wait)
            self._last[rank] = (consumer, request_seq, answer)
            return answer

    def _answer(self, rank: int, wait: float) -> pb.NextBatchResponse:
        # Once finished, no batch can arrive: an empty queue is the end, answered at once.
        if not self._finished.is_set() or not self._queue.empty():
            try:
                return pb.NextBatchResponse(batch=self._queue.get(timeout=wait), has_batch=True)
            except queue.Empty:
                pass
        if self._finished.is_set() and self._queue.empty():
            with self._lock:
                self._ended_ranks.add(rank)
                if len(self._ended_ranks) == self.num_consumers:
                    self._all_ended.set()
            return pb.NextBatchResponse(end_of_stream=True)
        return pb.NextBatchResponse()

    def wait_all_ended(self, timeout: float) -> bool:
        return self._all_ended.wait(timeout)


class DataLoaderServicer(data_loader_pb2_grpc.DataLoaderServicer):
    def __init__(self, batches: BatchQueue) -> None:
        self.batches = batches

    @grpc_method
    def NextBatch(self, request, context):
        return self.batches.next(request.rank, _POLL_SEC, request.consumer, request.request_seq)

    @grpc_method
    def Health(self, request, context):
        return common_pb2.HealthResponse(role="data-loader", configured=True)


class DataCtx:
    """Context of a data-loader process (as PERSIA's ``persia.ctx.DataCtx``).

    Args:
        port: port to serve NN workers on; by default ``PERSIA_DATA_LOADER_PORT`` (0: any).
        buffer_size: batches held for NN workers before ``send_data`` waits.
    """

    def __init__(self, *, port: int | None = None, buffer_size: int = 16,
                 env: PersiaEnv | None = None, global_config: GlobalConfig | None = None) -> None:
        self.env = env or PersiaEnv.from_environ()
        self.env.require("embedding_worker_addrs", ENV_EMBEDDING_WORKER_ADDRS)
        self.global_config = global_config or load_global_config(self.env.global_config)
        self.common = self.global_config.common_config
        self.port = port if port is not None else self.env.data_loader_port
        self.batches = BatchQueue(buffer_size, self.env.nn_world_size)
        self._seq = itertools.count()  # every batch the script makes, skipped ones too
        self._workers: list[EmbeddingWorkerClient] = []
        self._server: grpc.Server | None = None
        self.num_sent = 0
        self.num_skipped = 0
        # Resumed from a checkpoint: the batches of this loader trained before it.
        self._done = self.env.data_positions.of(self.env.data_loader_replica_index)
        self.metrics = DataLoaderMetrics()
        self._metrics_server: MetricsServer | None = None

    def __enter__(self) -> DataCtx:
        self._workers = [EmbeddingWorkerClient(a, self.common)
                         for a in self.env.embedding_worker_addrs]
        for w in self._workers:
            w.wait_ready()
        server, self.port = create_server(f"{self.env.bind_host}:{self.port}", self.common)
        data_loader_pb2_grpc.add_DataLoaderServicer_to_server(DataLoaderServicer(self.batches),
                                                              server)
        server.start()
        self._server = server
        print(f"data-loader {self.env.data_loader_replica_index} on port {self.port} ready",
              flush=True)
        metrics_port = metrics_port_from_env(os.environ)
        if metrics_port is not None:
            self._metrics_server = serve_metrics(
                self.metrics.registry, metrics_port, self.env.bind_host,
                f"data-loader {self.env.data_loader_replica_index}")
        return self

    def send_data(self, batch: PersiaBatch) -> None:
        """Send one batch; waits (never drops) while the embedding or NN workers are full."""
        if self._server is None:
            raise RuntimeError("DataCtx.send_data called outside `with DataCtx() as ctx:`")
        seq = next(self._seq)
        if self._done.done(seq):  # trained before the checkpoint this job resumed
            self.num_skipped += 1
            return
        started = time.perf_counter()
        worker_index = seq % len(self._workers)
        ref = self._put_ids(self._workers[worker_index], batch)
        message = pb.Batch(
            batch_id=batch_id(self.env.data_loader_replica_index, seq),
            batch_size=batch.batch_size,
            embedding_worker=worker_index,
            ref=ref,
            non_id_features=[common_pb2.NamedTensor(name=f.name, tensor=codec.encode(f.data))
                             for f in batch.non_id_type_features],
            labels=[common_pb2.NamedTensor(name=f.name, tensor=codec.encode(f.data))
                    for f in batch.labels],
            meta=batch.meta or b"",
            requires_grad=batch.requires_grad,
        )
        self._wait("NN workers to take batches", lambda t: self.batches.put(message, timeout=t))
        self.num_sent += 1
        self.metrics.send_seconds.observe(time.perf_counter() - started)
        self.metrics.batches.inc()
        self.metrics.samples.inc(batch.batch_size)

    def _put_ids(self, worker: EmbeddingWorkerClient, batch: PersiaBatch) -> int:
        def attempt(timeout: float) -> int:
            try:
                return worker.put_batch(batch.id_features(), batch.batch_size,
                                        batch.requires_grad, timeout=timeout)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise queue.Full from None
                raise
        return self._wait(f"room on embedding worker {worker.address}", attempt)

    def _wait(self, what: str, attempt):
        """Retry ``attempt(timeout)`` while it raises queue.Full, logging every minute."""
        started = last_log = time.monotonic()
        while True:
            try:
                return attempt(10.0)
            except queue.Full:
                now = time.monotonic()
                if now - last_log > 60:
                    logger.info("waiting %.0fs for %s", now - started, what)
                    last_log = now

    def __exit__(self, exc_type, exc, tb) -> None:
        self.batches.finish()
        try:
            if exc_type is None:
                started = time.monotonic()
                while not self.batches.wait_all_ended(60.0):
                    logger.info("waiting %.0fs for %d NN-worker ranks to drain the stream",
                                time.monotonic() - started, self.batches.num_consumers)
                logger.info("data loader %d sent %d batches (%d skipped: trained before the "
                            "checkpoint resumed)", self.env.data_loader_replica_index,
                            self.num_sent, self.num_skipped)
        finally:
            if self._server is not None:
                self._server.stop(grace=1.0).wait(5.0)
            if self._metrics_server is not None:
                self._metrics_server.close()
            for w in self._workers:
                w.close()


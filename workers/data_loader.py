"""The data-loader runtime: ``DataCtx().send_data(batch)`` (the service NN workers pull
from is :mod:`persia_py.workers.loader_service`).

``send_data`` stores the batch's ID features on an embedding worker (round robin), then
queues the rest (dense features, labels, the embedding worker's ref) for the NN workers.
Both steps wait when the other side is full: nothing is dropped. On exit, the context
waits until every NN-worker rank has been told the stream ended.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import time

import grpc

from persia_py.checkpoint import rewind
from persia_py.config import GlobalConfig, load_global_config
from persia_py.config.checks import check_type
from persia_py.embedding.data import PersiaBatch
from persia_py.env import ENV_EMBEDDING_WORKER_ADDRS, PersiaEnv
from persia_py.ids.positions import Position, batch_id
from persia_py.ops.final_errors import DataError, config_errors_are_final, made_progress
from persia_py.proto import common_pb2, data_loader_pb2_grpc
from persia_py.proto import data_loader_pb2 as pb
from persia_py.telemetry.events import Event, emit
from persia_py.telemetry.monitoring import (
    DataLoaderMetrics,
    MetricsServer,
    metrics_port_from_env,
    serve_metrics,
)
from persia_py.wire import codec
from persia_py.wire.rpc import create_server
from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient
from persia_py.workers.handover_log import HandoverLog, Handovers, take_rewind
from persia_py.workers.kept_batches import KeptBatches
from persia_py.workers.loader_service import BatchQueue, DataLoaderServicer

logger = logging.getLogger(__name__)


def new_stream(index: int) -> str:
    """A new identity for loader ``index``'s batches at the embedding workers and parameter
    servers: random per start of the training (128 bits), so never one an earlier run's
    updates used, and not one a caller could guess to pre-mark a batch's update as applied
    (the parameter servers would then acknowledge the real one without applying it)."""
    return f"loader{index}-{secrets.token_hex(16)}"


class DataCtx:
    """Context of a data-loader process (as PERSIA's ``persia.ctx.DataCtx``).

    Args:
        port: port to serve NN workers on; by default ``PERSIA_DATA_LOADER_PORT`` (0: any).
        buffer_size: batches held for NN workers before ``send_data`` waits (at least 1:
            the queue is bounded, so a loader faster than training waits, not its memory).
        env, global_config: this process's environment and global config (None: read
            from its environment variables and ``PERSIA_GLOBAL_CONFIG``).
    """

    @config_errors_are_final
    def __init__(self, *, port: int | None = None, buffer_size: int = 16,
                 env: PersiaEnv | None = None, global_config: GlobalConfig | None = None) -> None:
        # Every argument first, before any file or environment is read.
        check_type("DataCtx(port=...)", port, int, "an int (0: any free port) or None",
                   optional=True)
        if port is not None and not 0 <= port <= 65535:
            raise ValueError(f"DataCtx(port=...): expected 0 <= port <= 65535, got {port}")
        check_type("DataCtx(buffer_size=...)", buffer_size, int,
                   "an int >= 1 (batches held for the NN workers)")
        if buffer_size < 1:  # queue.Queue(0) would be unbounded
            raise ValueError(f"DataCtx(buffer_size=...): expected an int >= 1, got {buffer_size}")
        check_type("DataCtx(env=...)", env, PersiaEnv,
                   "a persia_py.env.PersiaEnv or None (read from the environment)",
                   optional=True)
        check_type("DataCtx(global_config=...)", global_config, GlobalConfig,
                   "a persia_py.config.GlobalConfig (e.g. load_global_config(path)) or None",
                   optional=True)
        self.env = env if env is not None else PersiaEnv.from_environ()
        self.env.require("embedding_worker_addrs", ENV_EMBEDDING_WORKER_ADDRS)
        self.global_config = (global_config if global_config is not None
                              else load_global_config(self.env.global_config))
        self.common = self.global_config.common_config
        self.port = port if port is not None else self.env.data_loader_port
        self.buffer_size = buffer_size
        self.log: HandoverLog | None = None
        """This loader's handover log (opened by :meth:`recover`)."""
        self.batches: BatchQueue | None = None
        self.next_seq = 0
        """Sequence number of the next batch the script makes (skipped ones count too)."""
        self._workers: list[EmbeddingWorkerClient] = []
        self._server: grpc.Server | None = None
        self._servicer: DataLoaderServicer | None = None
        self.num_sent = 0
        self.num_skipped = 0
        self.kept = KeptBatches()
        self.metrics = DataLoaderMetrics()
        self._metrics_server: MetricsServer | None = None

    def recover(self) -> DataCtx:
        """Where this loader starts: the batches trained before the checkpoint the job
        resumed (or was rewound to), and, restarted alone, what its handover log says the
        NN workers finished or hold. Reads (and replays) the log; ``with DataCtx()`` calls
        it on entry, once. Returns the context."""
        if self.batches is not None:
            return self
        index = self.env.data_loader_replica_index
        # Resumed from a checkpoint: the batches of this loader trained before it.
        self._done = self.env.data_positions.of(index)
        log_path = self.env.data_loader_handover_log
        # Rewound by a restarted training (persia_py/checkpoint/rewind.py): its checkpoint's
        # positions win, and the handover log starts again (it belongs to the stream before).
        rewound = None if log_path is None else take_rewind(
            log_path, replayed=self.env.data_loader_replay, index=index)
        if rewound is not None:
            self._done = rewound
        replay = self.env.data_loader_replay and rewound is None
        self.log = (None if log_path is None else
                    HandoverLog(log_path, replay=replay, trained=self._done))
        self.batches = BatchQueue(self.buffer_size, self.env.nn_world_size, self.log)
        recovered = Handovers(finished=self._done) if self.log is None else self.log.recovered
        # Kept by a loader restarted alone (see workers/handover_log.py).
        self.stream = recovered.stream or new_stream(index)
        # Restarted alone: skip what the NN workers finished, make again what they hold.
        self._done = recovered.finished
        self._in_training = recovered.in_training
        self._last_handed = {h.seq: h.rank for h in recovered.last.values()}
        # Batches made before this start: trained, or handed over and in training.
        self._made_before = max([self._done.next, *(s + 1 for s in self._done.also),
                                 *(s + 1 for s in self._in_training)])
        if self.log is not None:
            if recovered.stream is None:
                self.log.stream(self.stream)
            if rewound is not None:  # the new log holds the new stream: done with it
                os.unlink(rewind.rewind_file(self.log.path))
            if replay:
                self.kept.expect(batch_id(index, seq) for seq in self._in_training)
                self.batches.recover(recovered)
                logger.warning("data loader %d restarted: batches below %d finished (and %d "
                               "more), %d in training by the NN workers; going on after them",
                               index, self._done.next, len(self._done.also),
                               len(self._in_training))
        self._check_ready()
        return self

    def __enter__(self) -> DataCtx:
        self.recover()
        self._workers = [EmbeddingWorkerClient(a, self.common)
                         for a in self.env.embedding_worker_addrs]
        for w in self._workers:
            w.wait_ready()
        server, self.port = create_server(f"{self.env.bind_host}:{self.port}", self.common)
        self._servicer = DataLoaderServicer(self._queue, self.kept, self._resend,
                                            loader_index=self.env.data_loader_replica_index,
                                            num_made=lambda: self.num_made)
        data_loader_pb2_grpc.add_DataLoaderServicer_to_server(self._servicer, server)
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

    @property
    def num_made(self) -> int:
        """Batches this loader's stream has made: every sequence number below it, those
        made before a restart and trained before the checkpoint it started from too."""
        return max(self.next_seq, self._made_before)

    @property
    def resumed_position(self) -> Position:
        """This loader's batches trained before it started: before the checkpoint the job
        resumed from, and, restarted alone, those its predecessor's NN workers finished."""
        return self._done

    def start_at(self, seq: int) -> None:
        """Number the next batch ``seq``: a source that can seek (a stream, see
        :mod:`persia_py.stream_source`) starts at the first batch not trained instead of
        making the trained ones again. Only before any batch, and never past one that
        is not trained."""
        if self.next_seq != 0:
            raise RuntimeError(f"start_at({seq}) after {self.next_seq} batches were made")
        if not 0 <= seq <= self._done.next:
            raise ValueError(f"start_at({seq}): batches from {self._done.next} on are not all "
                             "trained; a loader may skip only trained batches")
        self.next_seq = seq

    def send_data(self, batch: PersiaBatch) -> None:
        """Send one batch; waits (never drops) while the embedding or NN workers are full."""
        check_type("DataCtx.send_data(batch)", batch, PersiaBatch,
                   "a persia_py.embedding.data.PersiaBatch")
        if self._server is None:
            raise RuntimeError("DataCtx.send_data is used outside its context; use it inside "
                               "`with DataCtx() as ctx:`")
        seq = self.next_seq
        self.next_seq += 1
        if self._done.done(seq):  # trained before the checkpoint this job resumed
            self.num_skipped += 1
            return
        worker_index = seq % len(self._workers)
        id_ = batch_id(self.env.data_loader_replica_index, seq)
        if seq in self._in_training:  # handed over before this loader restarted
            self._made_again(seq, id_, worker_index, batch)
            return
        started = time.perf_counter()
        ref = self._put_ids(self._workers[worker_index], batch, id_)
        if batch.requires_grad:
            self.kept.keep(id_, worker_index, batch)
        self._wait("NN workers to take batches",
                   lambda t: self._queue.put(self._message(batch, id_, worker_index, ref),
                                              timeout=t))
        self.num_sent += 1
        if self.num_sent == 1:  # a config error from now on is no longer one at start
            made_progress()
        self.metrics.send_seconds.observe(time.perf_counter() - started)
        self.metrics.batches.inc()
        self.metrics.samples.inc(batch.batch_size)

    def _made_again(self, seq: int, id_: int, worker_index: int, batch: PersiaBatch) -> None:
        """A batch the dead loader had handed over: kept for a resend, and the answer to
        its rank's request should that be retried; not sent again."""
        self.num_skipped += 1
        del self._in_training[seq]
        if batch.requires_grad:
            self.kept.keep(id_, worker_index, batch, expected=True)
        rank = self._last_handed.get(seq)
        if rank is not None:
            # The put is idempotent: if the batch still waits there, its ref comes back.
            self._queue.rebuilt(rank, lambda: pb.NextBatchResponse(
                batch=self._message(batch, id_, worker_index,
                                    self._put_ids(self._workers[worker_index], batch, id_)),
                has_batch=True))
        self._check_ready()

    @property
    def _queue(self) -> BatchQueue:
        """The batches for the NN workers, which :meth:`recover` makes."""
        if self.batches is None:
            raise RuntimeError("DataCtx: use it as `with DataCtx(...) as ctx:` (or call "
                               "recover() first)")
        return self.batches

    def _check_ready(self) -> None:
        if not self._in_training:
            self._queue.ready()

    @staticmethod
    def _message(batch: PersiaBatch, id_: int, worker_index: int, ref: int) -> pb.Batch:
        return pb.Batch(
            batch_id=id_,
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

    def _put_ids(self, worker: EmbeddingWorkerClient, batch: PersiaBatch, id_: int) -> int:
        def attempt(timeout: float) -> int:
            try:
                return worker.put_batch(batch.id_features(), batch.batch_size,
                                        batch.requires_grad, timeout=timeout,
                                        identity=(self.stream, id_))
            except grpc.RpcError as exc:
                # Full, or down (restarting): a put with an identity is safe to repeat.
                if exc.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise queue.Full from None
                raise
        return self._wait(f"room on embedding worker {worker.address}", attempt, self.common.rpc_timeout_sec)

    def _resend(self, id_: int) -> tuple[int, int]:
        """Put a kept batch on its embedding worker again (which restarted): (worker
        index, ref)."""
        worker_index, batch = self.kept.get(id_)
        logger.warning("batch %d: putting its ID features on embedding worker %d again (it "
                       "restarted)", id_, worker_index)
        emit(Event.BATCH_RESENT, batch=id_, embedding_worker=worker_index)
        return worker_index, self._put_ids(self._workers[worker_index], batch, id_)

    def _wait(self, what: str, attempt, timeout: float = 10.0):
        """Retry ``attempt(timeout)`` while it raises queue.Full, logging every minute."""
        started = last_log = time.monotonic()
        while True:
            try:
                return attempt(timeout)
            except queue.Full:
                now = time.monotonic()
                if now - last_log > 60:
                    logger.info("waiting %.0fs for %s", now - started, what)
                    last_log = now

    def __exit__(self, exc_type, exc, tb) -> None:
        # The stream ends for the NN workers only when it really ended: its script's end,
        # or input that cannot be parsed (a DataError, final: the batches made before it
        # are trained, then the process exits DATA_EXIT_CODE). Any other error is a
        # crash its restart goes on from (the handover log): ranks told the end now
        # would stop training with the stream still going.
        try:
            if exc_type is None or isinstance(exc, DataError):
                if exc is not None:
                    logger.error("data loader %d: %s; the stream ends after the %d batches "
                                 "made before it", self.env.data_loader_replica_index, exc,
                                 self.num_made)
                self._end_stream()
        finally:
            self._close()

    def _end_stream(self) -> None:
        """Tell the NN workers the stream ended; wait until every rank knows and every
        batch is done."""
        self._queue.finish()
        if self._in_training:
            logger.warning("data loader %d: the script ended before making again %d batches "
                           "handed over before the restart (is it deterministic?)",
                           self.env.data_loader_replica_index, len(self._in_training))
            self.kept.done(batch_id(self.env.data_loader_replica_index, s)
                           for s in self._in_training)
            self._queue.ready()
        started = time.monotonic()
        while not self._queue.wait_all_ended(60.0):
            logger.info("waiting %.0fs for %d NN-worker ranks to drain the stream",
                        time.monotonic() - started, self._queue.num_consumers)
        # Batches still in training may need a resend (their embedding worker
        # restarting): kept until the NN workers say they finished.
        if not self.kept.wait_empty(self.common.rpc_timeout_sec):
            logger.warning("%d batches not acknowledged by the NN workers within %.0f s "
                           "after the stream ended; no longer kept for a resend",
                           len(self.kept), self.common.rpc_timeout_sec)
        logger.info("data loader %d sent %d batches (%d skipped: trained before the "
                    "checkpoint resumed, or handed over before a restart; %d re-sent "
                    "to restarted embedding workers)",
                    self.env.data_loader_replica_index, self.num_sent,
                    self.num_skipped, self.kept.num_resent)
        emit(Event.LOADER_FINISHED, loader=self.env.data_loader_replica_index,
             sent=self.num_sent, skipped=self.num_skipped, resent=self.kept.num_resent)
        # The stop below gives calls in flight only a short grace; a loaded
        # machine can take longer to send the answer that ended the stream.
        if self._servicer is not None and not self._servicer.wait_answered(
                self.common.rpc_timeout_sec):
            logger.warning("an answer to the NN workers was still on its way %.0f s "
                           "after the stream ended; stopping anyway",
                           self.common.rpc_timeout_sec)

    def _close(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1.0).wait(5.0)
        if self.log is not None:
            self.log.close()
        if self._metrics_server is not None:
            self._metrics_server.close()
        for w in self._workers:
            w.close()

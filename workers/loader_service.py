"""The service a data loader offers the NN workers: :class:`BatchQueue` (its batches, each
handed to one rank, recorded in the handover log) and :class:`DataLoaderServicer` (its gRPC
methods: the next batch, a batch put again on a restarted embedding worker, health,
rewind). :class:`persia_py.workers.data_loader.DataCtx` fills the queue."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import grpc

from persia_py.checkpoint import rewind
from persia_py.ids.positions import DataPositions, loader_of, seq_of
from persia_py.proto import common_pb2, data_loader_pb2_grpc
from persia_py.proto import data_loader_pb2 as pb
from persia_py.wire.rpc import FailedPrecondition, NotFound, Overloaded, grpc_method
from persia_py.workers.handover_log import Handover, HandoverLog, Handovers
from persia_py.workers.kept_batches import KeptBatches

__all__ = ["BatchQueue", "DataLoaderServicer"]

logger = logging.getLogger(__name__)

_POLL_SEC = 0.5
"""How long NextBatch holds a request open waiting for a batch (long poll)."""
MAX_LEAD = 4
"""Most batches a rank is handed beyond the rank handed the fewest (of those the stream
has not ended for). The ranks train in step, so a rank whose buffer took a whole burst
would wait in its first collective for a rank that found none: bounded, the burst is
shared. Never binding while the ranks pull at the pace they train (a rank that many
ahead holds that many more untrained batches than the other, whose buffer then has
room and asks)."""


class BatchQueue:
    """Batches waiting for NN workers, and which ranks have seen the end of the stream.
    A rank is handed at most :data:`MAX_LEAD` batches beyond the others.

    ``next`` answers a repeated request (same consumer and request sequence) with the
    answer the first one got: a reply lost on the wire is asked for again and loses no
    batch. A rank's requests are answered one at a time, so a retry that arrives while
    the first attempt is still waiting for a batch gets that attempt's answer."""

    _MAX_CONSUMER_BYTES = 64

    def __init__(self, maxsize: int, num_consumers: int, log: HandoverLog | None = None) -> None:
        self._queue: queue.Queue[pb.Batch] = queue.Queue(maxsize=maxsize)
        self._finished = threading.Event()
        self._ended_ranks: set[int] = set()
        self._all_ended = threading.Event()
        self.num_consumers = num_consumers
        self._lock = threading.Lock()
        self._rank_locks = [threading.Lock() for _ in range(num_consumers)]
        self._last: dict[int, tuple[bytes, int, pb.NextBatchResponse | None]] = {}
        self._rebuilt: dict[int, Callable[[], pb.NextBatchResponse]] = {}
        self._ready = threading.Event()
        self._ready.set()
        self._handed = [0] * num_consumers
        self._turns = threading.Condition(self._lock)
        """Notified when a rank is handed a batch or ended: a rank past the lead may go."""
        self.log = log
        self.num_repeated = 0
        """Answers given again to a retried request."""

    def recover(self, handovers: Handovers) -> None:
        """A restart after a crash (see workers/handover_log.py): the ranks told the end
        already count as ended, and each rank's last request, retried, gets its batch
        again once :meth:`rebuilt` made it. Batches wait until :meth:`ready`."""
        self._ready.clear()
        for rank in handovers.ended:
            self._end(rank)
        for rank, handover in handovers.last.items():
            # A finished batch's request is never retried: its rank asked again since.
            if 0 <= rank < self.num_consumers and handover.seq in handovers.in_training:
                self._last[rank] = (handover.consumer, handover.request_seq, None)

    def rebuilt(self, rank: int, answer: Callable[[], pb.NextBatchResponse]) -> None:
        """How to answer ``rank``'s last request again (its batch, made again)."""
        self._rebuilt[rank] = answer

    def ready(self) -> None:
        """Every batch handed over before the crash is made again: answer requests."""
        self._ready.set()

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
        if not self._ready.wait(wait):
            raise Overloaded("this data loader restarted and is making again the batches it "
                             "had handed over; retry")
        with self._rank_locks[rank]:
            last = self._last.get(rank) if consumer else None  # no consumer: no retries
            if last is not None and last[:2] == (consumer, request_seq):
                self.num_repeated += 1
                repeated = last[2]
                if repeated is None:  # handed over before a restart: made again
                    repeated = self._rebuilt.pop(rank)()
                    self._last[rank] = (consumer, request_seq, repeated)
                return repeated
            answer = self._answer(rank, wait)
            if self.log is not None and answer.has_batch:  # before it leaves
                self.log.handed(Handover(seq_of(answer.batch.batch_id), rank, consumer,
                                         request_seq))
            self._last[rank] = (consumer, request_seq, answer)
            return answer

    def _answer(self, rank: int, wait: float) -> pb.NextBatchResponse:
        deadline = time.monotonic() + wait
        # Once finished, no batch can arrive: an empty queue is the end, answered at once.
        if (not self._finished.is_set() or not self._queue.empty()) and self._turn(rank, deadline):
            try:
                batch = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pass
            else:
                with self._turns:
                    self._handed[rank] += 1
                    self._turns.notify_all()
                return pb.NextBatchResponse(batch=batch, has_batch=True)
        if self._finished.is_set() and self._queue.empty():
            if self.log is not None and rank not in self._ended_ranks:
                self.log.ended(rank)
            self._end(rank)
            return pb.NextBatchResponse(end_of_stream=True)
        return pb.NextBatchResponse()

    def _turn(self, rank: int, deadline: float) -> bool:
        """Wait until ``rank`` is less than :data:`MAX_LEAD` batches ahead of every rank the
        stream has not ended for (False at ``deadline``: the rank asks again)."""
        with self._turns:
            while True:
                behind = [n for r, n in enumerate(self._handed) if r not in self._ended_ranks]
                if not behind or self._handed[rank] < min(behind) + MAX_LEAD:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._turns.wait(left)

    def _end(self, rank: int) -> None:
        with self._turns:
            self._ended_ranks.add(rank)
            if len(self._ended_ranks) == self.num_consumers:
                self._all_ended.set()
            self._turns.notify_all()

    def wait_all_ended(self, timeout: float) -> bool:
        return self._all_ended.wait(timeout)


class _CallsInFlight:
    """NextBatch calls whose answer has not left yet: the one that tells the last rank
    the end of the stream, or the last finished batches, completes the stream while it
    is still to be delivered."""

    def __init__(self) -> None:
        self._count = 0
        self._changed = threading.Condition()

    def enter(self, context: grpc.ServicerContext) -> None:
        if context is None:  # called directly, not over gRPC: no answer to deliver
            return
        with self._changed:
            self._count += 1
        # Called when the call is over on the server (its answer sent, or cancelled).
        if not context.add_callback(self._leave):
            self._leave()  # already over

    def _leave(self) -> None:
        with self._changed:
            self._count -= 1
            self._changed.notify_all()

    def wait_none(self, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._count == 0, timeout)


class DataLoaderServicer(data_loader_pb2_grpc.DataLoaderServicer):
    """``num_made()``: how many batches this loader's stream has made (every sequence
    number below it); a ``Rewind`` may name no other."""

    def __init__(self, batches: BatchQueue, kept: KeptBatches | None = None,
                 resend: Callable[[int], tuple[int, int]] | None = None, *,
                 loader_index: int = 0, num_made: Callable[[], int] = lambda: 0) -> None:
        self.batches = batches
        self.kept = kept if kept is not None else KeptBatches()
        self.resend = resend
        self.loader_index = loader_index
        self.num_made = num_made
        self._in_flight = _CallsInFlight()

    def wait_answered(self, timeout: float) -> bool:
        """Wait until no NextBatch answer is on its way (up to ``timeout``; False if one
        still is). Once the stream has ended and every batch is done, call this before
        stopping the server: the answer that completed the stream (the last rank's end,
        or its last finished batches) may not have left yet, and a rank whose answer is
        cut off retries a loader that is gone, until its deadline, then fails."""
        return self._in_flight.wait_none(timeout)

    @grpc_method
    def NextBatch(self, request: pb.NextBatchRequest, context: grpc.ServicerContext
                  ) -> pb.NextBatchResponse:
        self._in_flight.enter(context)
        # Only this loader's batch ids: another loader's, cut to a sequence number, could
        # mark one of ours finished in the handover log.
        done = [b for b in request.done if loader_of(b) == self.loader_index]
        self.kept.done(done)
        if self.batches.log is not None:
            self.batches.log.done([seq_of(b) for b in done])
        if request.only_done:
            return pb.NextBatchResponse()
        return self.batches.next(request.rank, _POLL_SEC, request.consumer, request.request_seq)

    @grpc_method
    def ResendBatch(self, request: pb.ResendBatchRequest, context: grpc.ServicerContext
                    ) -> pb.ResendBatchResponse:
        if self.resend is None:
            raise NotFound("this data loader does not resend batches")
        worker_index, ref = self.resend(request.batch_id)
        return pb.ResendBatchResponse(embedding_worker=worker_index, ref=ref)

    @grpc_method
    def Health(self, request: common_pb2.HealthRequest, context: grpc.ServicerContext
               ) -> common_pb2.HealthResponse:
        return common_pb2.HealthResponse(role="data-loader", configured=True,
                                         instance=rewind.INSTANCE)

    @grpc_method
    def Rewind(self, request: common_pb2.RestartRequest, context: grpc.ServicerContext
               ) -> common_pb2.RestartResponse:
        """Go back to a restarted training's checkpoint (see persia_py/checkpoint/rewind.py)."""
        log = self.batches.log
        if log is None:
            raise FailedPrecondition(
                f"data loader {self.loader_index} keeps no handover log (--handover-log), "
                "where a rewind leaves its positions: it cannot be rewound")
        # Checked whole before anything is written (ValueError: INVALID_ARGUMENT).
        positions = DataPositions.from_text(request.positions, "RestartRequest.positions")
        rewind.check_made(positions.of(self.loader_index), self.loader_index, self.num_made())
        rewind.write_rewind(log.path, positions, log.recorded_stream)
        logger.warning("data loader %d: asked to rewind (%s): batches below %d trained",
                       self.loader_index, request.reason[:200],
                       positions.of(self.loader_index).next)
        rewind.exit_after_answer(context, f"data loader {self.loader_index}")
        return common_pb2.RestartResponse(instance=rewind.INSTANCE)

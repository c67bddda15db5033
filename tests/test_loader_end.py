"""A data loader that stops once its stream has ended waits for the answer that ended
it: on a loaded machine that answer can leave after the server's stop grace, and the
rank it was for would retry a loader that is gone, then fail (a job that ended cleanly
restarted from its final checkpoint)."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc

from persia_py.proto import data_loader_pb2 as pb
from persia_py.proto import data_loader_pb2_grpc
from persia_py.workers.loader_service import BatchQueue, DataLoaderServicer

_GRACE_SEC = 0.2
"""The server's stop grace here (the loader's is 1 s)."""


class _HeldAnswers:
    """``BatchQueue.next`` that holds each answer until :attr:`release` is set, as a loaded
    machine delays it; :attr:`entered` is set once a call is being answered."""

    def __init__(self, batches: BatchQueue, answer=None) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self._answer = answer or batches.next
        batches.next = self

    def __call__(self, *args, **kwargs) -> pb.NextBatchResponse:
        self.entered.set()
        answer = self._answer(*args, **kwargs)
        assert self.release.wait(30)
        return answer


def _serve(batches: BatchQueue) -> tuple[DataLoaderServicer, grpc.Server, grpc.Channel]:
    servicer = DataLoaderServicer(batches)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    data_loader_pb2_grpc.add_DataLoaderServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return servicer, server, grpc.insecure_channel(f"127.0.0.1:{port}")


def _end_answer_arrives(wait_answered: bool) -> pb.NextBatchResponse | grpc.RpcError:
    batches = BatchQueue(maxsize=4, num_consumers=1)
    batches.finish()  # a stream without batches: the first request is its end
    held = _HeldAnswers(batches)
    servicer, server, channel = _serve(batches)
    call = data_loader_pb2_grpc.DataLoaderStub(channel).NextBatch.future(
        pb.NextBatchRequest(rank=0), timeout=30)
    try:
        assert batches.wait_all_ended(30)  # what DataCtx.__exit__ waits for first
        assert held.entered.wait(30)
        if wait_answered:
            assert not servicer.wait_answered(0.1)  # the end's answer has not left yet
            held.release.set()
            assert servicer.wait_answered(30)
        server.stop(grace=_GRACE_SEC).wait(30)
        held.release.set()  # without the wait: the answer leaves after the stop
        try:
            return call.result(timeout=30)
        except grpc.RpcError as exc:
            return exc
    finally:
        held.release.set()
        server.stop(grace=None)
        channel.close()


def test_the_answer_that_ends_the_stream_reaches_its_rank() -> None:
    answer = _end_answer_arrives(wait_answered=True)
    assert isinstance(answer, pb.NextBatchResponse) and answer.end_of_stream, answer


def test_without_waiting_a_late_answer_is_cut_off() -> None:
    """What the wait is for: the stop alone cancels the answer still on its way."""
    answer = _end_answer_arrives(wait_answered=False)
    assert isinstance(answer, grpc.RpcError), answer
    assert answer.code() == grpc.StatusCode.UNAVAILABLE, answer


def test_a_call_its_rank_gave_up_on_is_not_waited_for() -> None:
    """A rank that cancels (or dies) while its NextBatch handler is still busy leaves
    nothing on its way: the loader does not wait out its deadline at the end."""
    batches = BatchQueue(maxsize=4, num_consumers=1)
    held = _HeldAnswers(batches, answer=lambda *args, **kwargs: pb.NextBatchResponse())
    servicer, server, channel = _serve(batches)
    try:
        call = data_loader_pb2_grpc.DataLoaderStub(channel).NextBatch.future(
            pb.NextBatchRequest(rank=0), timeout=30)
        assert held.entered.wait(30)
        assert not servicer.wait_answered(0.1)  # the handler is at work
        call.cancel()
        assert servicer.wait_answered(10)  # while the handler still is
        assert not held.release.is_set()
    finally:
        held.release.set()
        server.stop(grace=None)
        channel.close()

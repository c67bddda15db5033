"""A data loader that stops once its stream has ended waits for the answer that ended
it: on a loaded machine that answer can leave after the server's stop grace, and the
rank it was for would retry a loader that is gone, then fail (a job that ended cleanly
restarted from its final checkpoint)."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc

from persia_py.proto import data_loader_pb2 as pb
from persia_py.proto import data_loader_pb2_grpc
from persia_py.workers.loader_service import BatchQueue, DataLoaderServicer

_GRACE_SEC = 0.2
"""The server's stop grace here (the loader's is 1 s); the held answer takes longer."""


def _end_answer_arrives(wait_answered: bool) -> pb.NextBatchResponse | grpc.RpcError:
    batches = BatchQueue(maxsize=4, num_consumers=1)
    batches.finish()  # a stream without batches: the first request is its end
    answer_stream_end = batches.next

    def slow_next(*args, **kwargs):
        answer = answer_stream_end(*args, **kwargs)
        time.sleep(5 * _GRACE_SEC)  # the answer leaves late, as on a loaded machine
        return answer

    batches.next = slow_next
    servicer = DataLoaderServicer(batches)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    data_loader_pb2_grpc.add_DataLoaderServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    got: list = []
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")

    def ask() -> None:
        try:
            got.append(data_loader_pb2_grpc.DataLoaderStub(channel).NextBatch(
                pb.NextBatchRequest(rank=0), timeout=30))
        except grpc.RpcError as exc:
            got.append(exc)

    rank = threading.Thread(target=ask)
    rank.start()
    try:
        assert batches.wait_all_ended(30)  # what DataCtx.__exit__ waits for first
        if wait_answered:
            assert servicer.wait_answered(30)
        server.stop(grace=_GRACE_SEC).wait(30)
        rank.join(timeout=30)
        assert not rank.is_alive()
    finally:
        server.stop(grace=None)
        channel.close()
    return got[0]


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
    entered, release = threading.Event(), threading.Event()

    def busy_next(*args, **kwargs):
        entered.set()
        release.wait(30)
        return pb.NextBatchResponse()

    batches.next = busy_next
    servicer = DataLoaderServicer(batches)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    data_loader_pb2_grpc.add_DataLoaderServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        call = data_loader_pb2_grpc.DataLoaderStub(channel).NextBatch.future(
            pb.NextBatchRequest(rank=0), timeout=30)
        assert entered.wait(30)
        assert not servicer.wait_answered(0.1)  # the handler is at work
        call.cancel()
        assert servicer.wait_answered(10)  # while the handler still is
        assert not release.is_set()
    finally:
        release.set()
        server.stop(grace=None)
        channel.close()

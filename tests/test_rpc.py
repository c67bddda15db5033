"""persia_py.wire.rpc: which failures ``call`` retries."""

from __future__ import annotations

import logging
import re

import grpc
import pytest

from persia_py.config import CommonConfig
from persia_py.proto import (  # noqa: F401 - imported to register the services' descriptors
    checkpoint_pb2,
    embedding_worker_pb2,
    parameter_server_pb2,
    serving_pb2,
)
from persia_py.wire.rpc import _request_limit, call, create_channel, create_server

LIMIT = 4 * 1024 * 1024  # the smallest allowed


@pytest.fixture()
def echo_channel():
    common = CommonConfig(max_message_bytes=LIMIT)
    server, port = create_server("127.0.0.1:0", common, max_workers=2)
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Echo", {"Echo": handler}),))
    server.start()
    channel = create_channel(f"127.0.0.1:{port}", common)
    try:
        yield channel
    finally:
        channel.close()
        server.stop(None)


def test_message_over_the_size_limit_is_refused_once_not_retried(echo_channel) -> None:
    echo = echo_channel.unary_unary("/test.Echo/Echo")
    attempts = []

    def counted(request, **kwargs):
        attempts.append(len(request))
        return echo(request, **kwargs)

    assert call(counted, b"x" * 10, timeout=30, idempotent=True, what="echo") == b"x" * 10
    with pytest.raises(grpc.RpcError) as info:
        call(counted, b"x" * (2 * LIMIT), timeout=30, idempotent=True, what="echo")
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert attempts == [10, 2 * LIMIT]  # one attempt each: the big one was not retried


@pytest.mark.parametrize("method, control", [
    ("/persia_py.ParameterServer/Configure", True),
    ("/persia_py.ParameterServer/Stats", True),
    ("/persia_py.EmbeddingWorker/Health", True),
    ("/persia_py.EmbeddingWorker/Lookup", True),  # by ref
    ("/persia_py.ParameterServerCheckpoint/Dump", True),
    ("/persia_py.ParameterServer/Update", False),
    ("/persia_py.EmbeddingWorker/PutBatch", False),
    ("/persia_py.Serving/Predict", False),
    ("/test.Echo/Echo", False),  # unknown to protobuf: the general limit
])
def test_calls_without_arrays_get_the_control_message_limit(method: str, control: bool) -> None:
    common = CommonConfig(max_control_message_bytes=100_000)
    assert _request_limit(method, common) == ((100_000, "common_config.max_control_message_bytes")
                                              if control else
                                              (common.max_message_bytes,
                                               "common_config.max_message_bytes"))



def test_a_call_that_runs_out_its_deadline_unavailable_names_the_peer(caplog) -> None:
    # A peer whose host stopped answering ARP: its connect ran out the whole deadline, then
    # failed UNAVAILABLE (no route to host), with no earlier attempt to log the outage.
    # Here the call's deadline is shorter than its first back-off, so its one attempt
    # fails UNAVAILABLE with no time left to retry, as that one did.
    common = CommonConfig()
    server, port = create_server("127.0.0.1:0", common, max_workers=1)
    server.start()
    server.stop(None)  # nothing listens there now: a real UNAVAILABLE from the channel
    channel = create_channel(f"127.0.0.1:{port}", common)
    echo = channel.unary_unary("/test.Echo/Echo")
    attempts = []

    def unreachable(request, timeout, **kwargs):
        attempts.append(timeout)
        return echo(request, timeout=30, **kwargs)  # refused: UNAVAILABLE, whatever is left

    try:
        with caplog.at_level(logging.WARNING, logger="persia_py.wire.rpc"):
            with pytest.raises(grpc.RpcError) as info:
                call(unreachable, b"x", timeout=0.005, idempotent=True,
                     what=f"echo at 127.0.0.1:{port}")
    finally:
        channel.close()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and len(attempts) == 1
    assert re.search(rf"echo at 127\.0\.0\.1:{port} unavailable \(.*\); gave up at the "
                     r"call's deadline", caplog.text), caplog.text

"""persia_py.rpc: which failures ``call`` retries."""

from __future__ import annotations

import grpc
import pytest

from persia_py.config import CommonConfig
from persia_py.rpc import call, create_channel, create_server

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

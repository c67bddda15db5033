"""The metrics endpoint (``persia_py.telemetry.monitoring.serve_metrics``) serves a bounded number of
connections at once: one more is answered 503 at once, without a thread of its own, and
the endpoint serves again once the others are done."""

from __future__ import annotations

import socket
import urllib.request

from prometheus_client import CollectorRegistry, Counter

from persia_py.telemetry.monitoring import MAX_METRICS_CONNECTIONS, serve_metrics


def _get(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer


def test_connections_beyond_the_cap_are_refused_at_once_without_a_thread() -> None:
    registry = CollectorRegistry()
    Counter("persia_test_scrapes", "A sample to find in the answer", registry=registry).inc()
    server = serve_metrics(registry, 0, "127.0.0.1", "test")
    address = ("127.0.0.1", server.port)
    held = []
    try:
        # Connections that send nothing: each holds one of the endpoint's threads.
        held = [socket.create_connection(address, timeout=20)
                for _ in range(MAX_METRICS_CONNECTIONS)]
        with socket.create_connection(address, timeout=20) as extra:
            # Accepted after the held ones (one listen queue): answered without a request.
            assert extra.recv(1024).startswith(b"HTTP/1.0 503 Service Unavailable")
            assert extra.recv(1024) == b""  # and closed
        assert server.num_connections == MAX_METRICS_CONNECTIONS  # the refused one: none
        # A held connection is served as usual.
        assert b"persia_test_scrapes_total 1.0" in _get(held.pop())
        for sock in held:
            sock.close()
        held = []
        assert server.wait_idle(timeout=20)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics",
                                    timeout=20) as answer:
            assert b"persia_test_scrapes_total 1.0" in answer.read()
    finally:
        for sock in held:
            sock.close()
        server.close()

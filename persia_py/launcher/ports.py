"""Ports for the roles of a local job, chosen where outgoing connections never land.

A port found free is only free until something takes it. Bound to port 0 and released
(the usual way), it lies in the kernel's ephemeral range, the same range every
``connect()`` on the machine takes its local port from: the job's own gRPC channels,
its metrics scrapes, other jobs' connections. One of them may take the port before the
role binds it, and keep it as long as the connection lives; the role then fails to bind
and, since the other roles already know its address, restarts into the same error. A
port below the ephemeral range is never handed to a connection; only a process that
names it explicitly can take it.
"""

from __future__ import annotations

import random
import socket

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10000
"""The least port chosen: below it lie the well-known and many registered services."""
_TRIES_PER_PORT = 64


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int] | None:
    """The kernel's ephemeral port range (inclusive), None where it cannot be read."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return None
    return low, high


def free_ports(count: int, host: str, ephemeral: tuple[int, int] | None = None) -> list[int]:
    """``count`` distinct ports of ``host`` that are free right now: random ones below
    the ephemeral range (``ephemeral``, else the kernel's), each checked by binding it,
    where the range leaves room there; else ports bound to port 0 and released."""
    span = ephemeral or ephemeral_range()
    below = range(LOWEST_PORT, span[0]) if span is not None else range(0)
    if len(below) >= 16 * count:
        return _free_in(below, count, host)
    return _free_any(count, host)


def _free_in(candidates: range, count: int, host: str) -> list[int]:
    chosen: list[int] = []
    for port in random.SystemRandom().sample(candidates, min(len(candidates),
                                                             _TRIES_PER_PORT * count)):
        if port not in chosen and _bindable(host, port):
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    return chosen + _free_any(count - len(chosen), host)  # a crowded range: any free ones


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _free_any(count: int, host: str) -> list[int]:
    """``count`` distinct ports bound to port 0, then released."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            sockets.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()

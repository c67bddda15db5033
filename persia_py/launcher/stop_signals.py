"""SIGTERM and SIGINT for a role's main thread, without relying on Python's handlers.

The kernel hands a process's signal to any of its threads that does not block it: to
OpenBLAS's, gRPC's or torch's store threads as often as to the main one. The C handler
then runs there and only flags the signal; Python runs the Python handler on the main
thread, but CPython (3.11, Linux) arms the main thread's check only when the C handler ran
on the main thread itself, or when another Python thread asks for the GIL. A process
whose other threads are native (a parameter server waiting in ``Event.wait``, a node
waiting on its ranks in ``select``) then never runs the handler: it slept through
SIGTERM until its supervisor killed it. And a handler that does run, runs between any
two bytecodes of the main thread, inside a lock that code holds too (``Event.set`` in
a handler waited forever for the lock of the ``Event.wait`` it interrupted).

So the Python handler does nothing, and the signals are read from a wakeup descriptor
(``signal.set_wakeup_fd``), into which the C handler writes each signal's number,
whichever thread took it: :func:`taken` drains it, and a main loop waits on
:func:`wakeup_fd` in its ``select`` beside whatever else it waits for.
"""

from __future__ import annotations

import os
import select
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_POLL_SEC = 1.0
"""The longest a wait goes without looking at the descriptor (a backstop: a signal makes
it readable at once)."""

_read_fd: int | None = None
_taken: list[int] = []
"""Every stop signal taken since :func:`on_stop_signals`, in order. One forwarded to a
data loader's script that then exits 78 still ends the hold that follows."""


def _nothing(_signum: int, _frame: object) -> None:
    """The Python handler: the wakeup descriptor holds the record (see the module)."""


def on_stop_signals() -> None:
    """From now on SIGTERM and SIGINT no longer stop the process; each is recorded for
    :func:`taken`. Main thread only (Python's rule for ``signal.signal``)."""
    global _read_fd
    for sig in STOP_SIGNALS:
        signal.signal(sig, _nothing)
    if _read_fd is None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        _read_fd = read_fd


def wakeup_fd() -> int:
    """The descriptor that turns readable when a signal comes (after :func:`on_stop_signals`)."""
    assert _read_fd is not None, "on_stop_signals() first"
    return _read_fd


def taken() -> list[int]:
    """The stop signals taken so far, in order (a copy)."""
    while True:
        try:
            data = os.read(wakeup_fd(), 512)
        except BlockingIOError:
            break
        _taken.extend(number for number in data if number in STOP_SIGNALS)
        if not data:
            break
    return list(_taken)


class Unread:
    """Hands out each stop signal once, for a loop that passes them on: :meth:`new`
    returns those taken since its last call."""

    def __init__(self) -> None:
        self._count = 0

    def new(self) -> list[int]:
        signals = taken()
        fresh, self._count = signals[self._count:], len(signals)
        return fresh


def wait_for_stop_signal() -> int:
    """The first stop signal, once one has come (at once if one has)."""
    while not (signals := taken()):
        select.select([wakeup_fd()], [], [], STOP_POLL_SEC)
    return signals[0]


class Requested:
    """Reads as an Event's ``is_set``, for loops that poll one: whether SIGTERM or SIGINT
    has come (after :func:`on_stop_signals`)."""

    def is_set(self) -> bool:
        return bool(taken())

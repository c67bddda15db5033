"""SIGTERM and SIGINT for a server role's main thread: note them, and wait for one.

Two things make this less simple than an Event set by a handler:

- The kernel hands a process's signal to any of its threads (gRPC's, OpenBLAS's). The C
  handler there only flags it; Python runs the handler on the main thread the next time
  that thread runs bytecode. A main thread blocked in an untimed lock wait never does,
  and sleeps through the signal until its supervisor kills it.
- The handler runs wherever the main thread is at that moment, between any two
  bytecodes: inside ``Event.wait``'s ``with self._cond`` too. A handler that takes a
  lock the interrupted code holds (``Event.set`` takes the event's) waits for itself.

So a handler here only appends to a list (no lock), and the wait blocks in ``select`` on
a wakeup file descriptor, into which the C handler writes a byte whichever thread took
the signal (``signal.set_wakeup_fd``).
"""

from __future__ import annotations

import os
import select
import signal
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_POLL_SEC = 1.0
"""The longest the wait goes without looking at what the handlers noted (a backstop: the
wakeup descriptor ends the wait as soon as a signal comes)."""

_taken: list[int] = []
"""The stop signals taken so far, in order. One forwarded to a data loader's script that
then exits 78 still ends the hold that follows."""


def on_stop_signals(also: Callable[[int], None] | None = None) -> None:
    """From now on SIGTERM and SIGINT are noted (for :func:`wait_for_stop_signal`), and
    passed to ``also`` (which must take no lock the main thread may hold, as the handler)."""
    def handler(signum: int, _frame: object) -> None:
        _taken.append(signum)
        if also is not None:
            also(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


def wait_for_stop_signal() -> None:
    """Return once SIGTERM or SIGINT has come (at once if one has). Main thread only,
    after :func:`on_stop_signals`."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    try:
        while not _taken:
            select.select([read_fd], [], [], STOP_POLL_SEC)
            try:
                os.read(read_fd, 512)  # drained; the handler runs at the next bytecode
            except BlockingIOError:
                pass
    finally:
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)

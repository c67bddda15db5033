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

Which signals stop a role is the supervisor's to say (``$PERSIA_STOP_SIGNALS``, read by
:func:`configured`): SIGTERM and SIGINT by default. Under Slurm (persia_py/launcher/slurm_run.py)
every process of a job gets SIGTERM at once when the job is cancelled or requeued, and
``srun`` turns a SIGTERM of its own into SIGKILL for its step, while it passes SIGUSR2 on as
it is. So there the servers stop on SIGUSR2 (and SIGINT) alone and ignore SIGTERM, until
the NN workers have written their final checkpoint and the supervisor stops them; the NN
workers stop on both. A signal that stops a role but not by default (SIGUSR2) is ignored
by the processes the role starts (:func:`child_ignores`): the step's signal reaches
every process of it, and would end a rank or torchrun by its default action.
"""

from __future__ import annotations

import os
import select
import signal
from collections.abc import Callable, Mapping

STOP_SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a role unless ``$PERSIA_STOP_SIGNALS`` says others."""
ENV_STOP_SIGNALS = "PERSIA_STOP_SIGNALS"
"""Comma-separated names (``SIGUSR2,SIGINT``) of the signals that stop a role; of
:data:`STOP_SIGNALS`, one not named is ignored (set by the supervisor that starts it)."""
STOP_POLL_SEC = 1.0
"""The longest a wait goes without looking at the descriptor (a backstop: a signal makes
it readable at once)."""

_read_fd: int | None = None
_stop_signals: tuple[int, ...] = STOP_SIGNALS
"""What :func:`on_stop_signals` made this process's stop signals (:func:`configured`)."""
_taken: list[int] = []
"""Every stop signal taken since :func:`on_stop_signals`, in order. One forwarded to a
data loader's script that then exits 78 still ends the hold that follows."""


def _nothing(_signum: int, _frame: object) -> None:
    """The Python handler: the wakeup descriptor holds the record (see the module)."""


def configured(environ: Mapping[str, str] = os.environ) -> tuple[int, ...]:
    """The signals that stop this role (``$PERSIA_STOP_SIGNALS``; default
    :data:`STOP_SIGNALS`)."""
    names = environ.get(ENV_STOP_SIGNALS)
    if not names:
        return STOP_SIGNALS
    found = []
    for name in names.split(","):
        sig = getattr(signal.Signals, name.strip().upper(), None)
        if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP):
            raise SystemExit(f"${ENV_STOP_SIGNALS}={names!r}: {name.strip()!r} is not a "
                             "signal a process can take (SIGTERM, SIGINT, SIGUSR2, ...)")
        found.append(int(sig))
    return tuple(found)


def child_ignores(stop: tuple[int, ...],
                  then: Callable[[], None] | None = None) -> Callable[[], None] | None:
    """A ``preexec_fn`` for a child of a role whose stop signals are ``stop``: it ignores
    those whose default action ends a process and that only the supervisor sends this way
    (not SIGTERM or SIGINT; SIG_IGN survives ``exec``), then runs ``then``. A step's
    signal reaches every process of the step: a child that kept the default action
    would die of one meant for the role, which passes SIGTERM on instead."""
    signals = [sig for sig in stop if sig not in STOP_SIGNALS]
    if not signals:
        return then

    def preexec() -> None:
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        if then is not None:
            then()
    return preexec


def on_stop_signals(environ: Mapping[str, str] = os.environ) -> None:
    """From now on the stop signals (:func:`configured`) no longer stop the process; each
    is recorded for :func:`taken`; one of SIGTERM and SIGINT that is not a stop signal is
    ignored. Main thread only (Python's rule for ``signal.signal``)."""
    global _read_fd, _stop_signals
    _stop_signals = configured(environ)
    for sig in STOP_SIGNALS:
        if sig not in _stop_signals:
            signal.signal(sig, signal.SIG_IGN)
    for sig in _stop_signals:
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
        _taken.extend(number for number in data if number in _stop_signals)
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
    """Reads as an Event's ``is_set``, for loops that poll one: whether a stop signal has
    come (after :func:`on_stop_signals`)."""

    def is_set(self) -> bool:
        return bool(taken())

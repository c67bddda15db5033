"""Stopping endless training on a signal, at a step every NN-worker rank agrees on.

An online job's stream never ends, so it stops when it is told: SIGTERM (what
``persia-launcher local``, ``kill`` and Kubernetes send). The signal may reach the ranks
at different moments, mid-step; stopping at once would leave the ranks' collectives
unmatched and the last step half done. So the handler only notes the request; after
each training step every rank all-reduces "was I asked?" (a maximum, one integer), and
all stop after the same step: in-flight steps finish, then ``TrainCtx`` waits for the
embedding updates, writes a final checkpoint and the script goes on past its loop.

A rank that ran out of batches while the others train (``torch.distributed`` ``Join``)
answers each of their agreements through :class:`_AgreeJoinHook`, so it never waits on
a collective the others do not make.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from persia_py.dense.collectives import WorldJoinable

_Handler = Callable[[int, FrameType | None], Any] | int | None
"""What ``signal.signal`` returns: the handler it replaced (SIG_DFL and SIG_IGN are ints)."""

logger = logging.getLogger(__name__)


class StopOnSignal(WorldJoinable):
    """Notes SIGTERM (and any other of ``signals``) and makes the ranks agree to stop.

    Use from the main thread (Python runs signal handlers there): :meth:`install` on
    entry, :meth:`agreed` after each training step, :meth:`restore` on exit.
    """

    def __init__(self, device: torch.device,
                 signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)) -> None:
        self._device = device
        self._signals = signals
        # A plain flag, no Event: the handler runs between any two bytecodes of the main
        # thread, and Event.set would wait for a lock that thread may hold (request()).
        self._requested = False
        self._previous: dict[signal.Signals, _Handler] = {}
        self.stopped = False
        """Every rank agreed to stop (after :meth:`agreed` returned True)."""
        super().__init__()

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("TrainCtx(stop_on_signal=True) must be entered in the main "
                               "thread: Python delivers signals only there")
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum, _frame) -> None:
        if not self._requested:
            # A raw write, neither print nor the logger: the handler may run while the
            # main thread holds stdout's lock or the logger's, and would fail or hang.
            _write_out(f"{signal.Signals(signum).name}: stopping after the current step "
                       "(final checkpoint follows)\n")
        self._requested = True

    def request(self) -> None:
        """Ask to stop, as the signal does (for code that decides to stop by itself)."""
        self._requested = True

    @property
    def requested(self) -> bool:
        """This rank was asked to stop (the ranks may not have agreed yet)."""
        return self._requested

    def agreed(self) -> bool:
        """After a training step: whether any rank was asked to stop (then all stop)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            self.stopped = self.requested
        else:
            self.stopped = self._all_reduce(int(self.requested)) > 0
        return self.stopped

    def _all_reduce(self, value: int) -> int:
        flag = torch.tensor([value], dtype=torch.int64, device=self.join_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def join_hook(self, **kwargs) -> JoinHook:
        return _AgreeJoinHook(self)


def _write_out(text: str) -> None:
    """``text`` onto standard output's file descriptor, in one system call."""
    try:
        os.write(sys.stdout.fileno(), text.encode())
    except (OSError, ValueError, AttributeError):  # no descriptor there (a test's capture)
        pass


class _AgreeJoinHook(JoinHook):
    """A rank out of batches takes part in each agreement of the ranks still training
    (not asked itself: its answer is 0), and learns whether they stop."""

    def __init__(self, stop: StopOnSignal) -> None:
        self._stop = stop

    def main_hook(self) -> None:
        if self._stop._all_reduce(int(self._stop.requested)) > 0:
            self._stop.stopped = True

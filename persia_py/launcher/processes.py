"""Processes of the launcher's children: tying them to their parent (Linux ``prctl``, see
persia_py/launcher/lifeline.py), finding them, and watching torchrun."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from persia_py.launcher import stop_signals
from persia_py.ops.final_errors import CONFIG_EXIT_CODE, ENV_RANK_FAILED_FILE, RANK_CONFIG_ERROR

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl() -> Callable[..., int]:
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                      ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child get ``sig`` when the thread calling
    ``Popen`` exits (its process dies). Everything is looked up before the fork; the
    child only calls ``prctl`` and compares its parent's pid."""
    prctl, parent = _prctl(), os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl: nobody will tell us
            os.kill(os.getpid(), sig)
    return preexec


def become_subreaper() -> None:
    """Make this process the parent of its orphaned descendants (instead of init)."""
    _prctl()(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _children() -> dict[int, list[int]]:
    """Every live process's children (Linux /proc walk)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        if state != "Z":  # a zombie has exited; its parent just has not reaped it yet
            children.setdefault(int(ppid), []).append(int(entry))
    return children


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    return _children().get(pid, [])


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``."""
    children = _children()
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def run_torchrun(command: list[str], env: dict[str, str], *, grace_sec: float) -> int:
    """Run torchrun in the foreground and return its code. SIGINT is passed on to
    torchrun, SIGTERM to its ranks (to torchrun before they start).

    A rank that fails writes why into ``$PERSIA_RANK_FAILED_FILE``
    (:func:`persia_py.ops.final_errors.report_failure`). torchrun then records the failure in
    its rendezvous store; when that store sits behind a dead link, the kernel retries
    the connection for many minutes and torchrun with it. So once a rank has failed and
    torchrun has had no rank running for ``grace_sec``, it is stopped, and the rank's
    reason is printed: the node ends with an error naming the peer it lost. A rank that
    stopped on a config error before any progress (its script's, or ``TrainCtx``'s:
    :mod:`persia_py.ops.final_errors`) stops torchrun at once, which would restart the
    ranks into the same error, and the code is ``CONFIG_EXIT_CODE``.
    """
    with rank_failed_file() as failed_file:
        # torchrun dies with this wrapper, which dies with the launcher (lifeline.py).
        child = subprocess.Popen(command, env={**env, ENV_RANK_FAILED_FILE: failed_file},
                                 preexec_fn=stop_signals.child_ignores(
                                     stop_signals.configured(), die_with_parent()))
        return _watch_torchrun(child, failed_file, grace_sec)


def _watch_torchrun(child: subprocess.Popen, failed_file: str, grace_sec: float) -> int:
    """:func:`run_torchrun`'s watch of ``child`` (torchrun) and of the ranks' failures."""

    def forward(signum, _frame):
        # SIGTERM goes to the ranks themselves while they run (for any stop signal but
        # SIGINT: SIGUSR2 under Slurm, persia_py/launcher/stop_signals.py): one that stops
        # cleanly on it (TrainCtx(stop_on_signal=True)) exits 0, and torchrun with it.
        # torchrun, signalled itself, would kill them 30 s later and fail whatever they did.
        term = signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM
        ranks = children(child.pid) if term == signal.SIGTERM else []
        for pid in ranks or [child.pid]:
            try:
                os.kill(pid, term)
            except ProcessLookupError:
                pass

    stop = stop_signals.configured()
    for sig in stop_signals.STOP_SIGNALS:
        if sig not in stop:
            signal.signal(sig, signal.SIG_IGN)
    for sig in stop:
        signal.signal(sig, forward)
    idle_since = None
    while True:
        try:
            code = child.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        reason = failure(failed_file)
        if reason is not None and RANK_CONFIG_ERROR in reason:
            # torchrun would restart the ranks into the same error. The rank that
            # wrote it waits for this (persia_py/ops/final_errors.py).
            line = next(x for x in reason.splitlines() if RANK_CONFIG_ERROR in x)
            print(f"[nn-worker] {line}; not restarting the ranks", flush=True)
            _kill_tree(child)
            return CONFIG_EXIT_CODE
        if code is not None:
            return code
        if reason is None or children(child.pid):
            idle_since = None
            continue
        idle_since = idle_since or time.monotonic()
        if time.monotonic() - idle_since >= grace_sec:
            print(f"[nn-worker] a rank failed and torchrun did not exit within "
                  f"{grace_sec:.0f} s (its rendezvous store is unreachable); stopping "
                  f"it. The rank's error: {reason}", flush=True)
            _kill_tree(child)
            return 1


@contextmanager
def rank_failed_file() -> Iterator[str]:
    """A path no file has yet, for the ranks' ``$PERSIA_RANK_FAILED_FILE``; the file is
    removed at the end."""
    fd, failed_file = tempfile.mkstemp(prefix="persia-rank-failed-")
    os.close(fd)
    os.unlink(failed_file)
    try:
        yield failed_file
    finally:
        if os.path.exists(failed_file):
            os.unlink(failed_file)


def failure(path: str) -> str | None:
    """What the ranks wrote into the failure file ``path`` (None: nothing yet)."""
    try:
        with open(path, errors="replace") as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def _kill_tree(child: subprocess.Popen) -> None:
    """SIGKILL ``child`` and every process below it; wait for ``child``."""
    for pid in [child.pid, *descendants(child.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    child.wait()

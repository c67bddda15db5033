"""Processes of the launcher's children: finding them, and watching torchrun."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time

from persia_py.env import ENV_RANK_FAILED_FILE


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
    """Run torchrun in the foreground (SIGTERM/SIGINT passed on) and return its code.

    A rank that fails writes why into ``$PERSIA_RANK_FAILED_FILE``
    (``persia_py.process_group.report_failure``). torchrun then records the failure in
    its rendezvous store; when that store sits behind a dead link, the kernel retries
    the connection for many minutes and torchrun with it. So once a rank has failed and
    torchrun has had no rank running for ``grace_sec``, it is stopped, and the rank's
    reason is printed: the node ends with an error naming the peer it lost.
    """
    fd, failed_file = tempfile.mkstemp(prefix="persia-rank-failed-")
    os.close(fd)
    os.unlink(failed_file)
    child = subprocess.Popen(command, env={**env, ENV_RANK_FAILED_FILE: failed_file})

    def forward(signum, _frame):
        child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    idle_since = None
    try:
        while True:
            try:
                return child.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            if not os.path.exists(failed_file) or children(child.pid):
                idle_since = None
                continue
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since >= grace_sec:
                with open(failed_file, errors="replace") as f:
                    reason = f.read().strip()
                print(f"[nn-worker] a rank failed and torchrun did not exit within "
                      f"{grace_sec:.0f} s (its rendezvous store is unreachable); stopping "
                      f"it. The rank's error: {reason}", flush=True)
                for pid in [child.pid, *descendants(child.pid)]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                child.wait()
                return 1
    finally:
        if os.path.exists(failed_file):
            os.unlink(failed_file)

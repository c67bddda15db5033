"""Processes that die with the launcher that started them, however it dies (Linux).

A launcher killed with SIGKILL runs no ``finally``: whatever it started would keep
running, holding its ports and memory. Two kernel facts close that gap, because neither
needs the dead process to do anything:

* **The parent-death signal** (``prctl(PR_SET_PDEATHSIG)``, set in the child between
  ``fork`` and ``exec``): the kernel sends it to a child when the *thread* that forked it
  exits. So it is set only by a thread that lives as long as its process (the main
  thread: every ``spawn`` of ``LocalCluster`` and every role's wrapper start their
  children there), and a child whose parent died before the ``prctl`` kills itself.
  It covers one generation: a process killed by it leaves its own children behind.
* **The lifeline**: a pipe whose write end only the launcher holds. Each role started by
  ``LocalCluster`` inherits the read end (``$PERSIA_LIFELINE_FD``) and watches it on a
  thread (:func:`watch_lifeline`); the read returns end-of-file once the launcher is
  gone, whatever killed it. The role then SIGKILLs every process below it and exits.
  It is made the *child subreaper* of its descendants, so a rank whose torchrun died
  first is re-parented to it, not to init, and is found and killed too. torchrun's
  ranks and a data loader's script are below a wrapper role, out of reach of the
  launcher's own parent-death signal: the lifeline is what stops them.

Servers (no children) get both; wrappers of user scripts (data loaders, NN workers)
the lifeline only, since the parent-death SIGKILL would stop them before they stopped
their children; their own children (the user's script, torchrun) get the parent-death
signal from them.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from persia_py.launcher.processes import become_subreaper, descendants

ENV_LIFELINE_FD = "PERSIA_LIFELINE_FD"
"""File descriptor of the read end of the launcher's lifeline, in a role it started."""
_KILL_DEADLINE_SEC = 10.0


class Lifeline:
    """The launcher's side: a pipe whose write end never leaves this process."""

    def __init__(self) -> None:
        # Both ends are close-on-exec; Popen(pass_fds=...) hands a child the read end only.
        self.read_fd, self._write_fd = os.pipe()

    def child_env(self, env: dict[str, str]) -> dict[str, str]:
        return {**env, ENV_LIFELINE_FD: str(self.read_fd)}

    def close(self) -> None:
        for fd in (self.read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def watch_lifeline(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """In a role started by a launcher: stop this process and every process below it
    when the launcher's lifeline breaks (see the module docstring). The variable is
    removed from ``environ``: this role's children are not the launcher's. False when
    this process has no lifeline."""
    value = environ.pop(ENV_LIFELINE_FD, None)
    if not value:
        return False
    fd = int(value)
    os.set_inheritable(fd, False)
    become_subreaper()

    def watch() -> None:
        while True:
            try:
                if not os.read(fd, 1):  # end of file: the launcher is gone
                    break
            except InterruptedError:
                continue
        # Nothing is printed: the output went to the launcher, a pipe nobody reads now.
        kill_descendants(os.getpid())
        os._exit(1)

    threading.Thread(target=watch, name="persia-lifeline", daemon=True).start()
    return True


def kill_descendants(pid: int) -> None:
    """SIGKILL every process below ``pid`` until none is left (parents before their
    children, so none starts another; one re-parented meanwhile is found again)."""
    deadline = time.monotonic() + _KILL_DEADLINE_SEC
    while (below := descendants(pid)) and time.monotonic() < deadline:
        for child in below:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)  # SIGKILL is delivered asynchronously; look again

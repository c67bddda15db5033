"""NN ranks on one node with no torchrun restarts, started without torchrun.

torchrun's agent, for one node that restarts nothing, only hosts the rendezvous store
and watches the ranks; yet it costs a process that imports torch before any rank starts
(docs/benchmarks.md#test-suite). ``persia-launcher nn-worker`` (:func:`run_ranks`) does
both itself instead, so the ranks start at once:

* each rank gets the environment torchrun's ``LocalElasticAgent`` gives it
  (:func:`rank_env`) and the command line (``python -u SCRIPT ARGS``), in a session of
  its own, as torchrun starts it;
* the store is torchrun's too (:mod:`persia_py.launcher.loopback_torchrun`): a
  ``TCPStore`` on a socket bound to 127.0.0.1 here, the ranks its clients
  (``TORCHELASTIC_USE_AGENT_STORE``). The socket listens from the start. With several
  ranks, torch is imported and the store made while they start; for a single rank
  (whose ``TrainCtx`` makes no process group) only if it dials the store, so such a
  node mostly imports no torch here at all;
* one rank failing stops the others as torchrun does (SIGTERM to their process groups,
  SIGKILL 30 s later) and the code is 1, as torchrun's; a rank that stopped on a config
  error before any progress (:mod:`persia_py.ops.final_errors`) makes it
  ``CONFIG_EXIT_CODE``. SIGINT stops the ranks as torchrun does (SIGINT, SIGKILL 30 s
  later; code 1); SIGTERM is passed on to the ranks, which may stop cleanly and exit 0,
  as :func:`persia_py.launcher.processes.run_torchrun` does.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

from persia_py.launcher import stop_signals
from persia_py.launcher.loopback import LOOPBACK
from persia_py.launcher.processes import die_with_parent, failure, rank_failed_file
from persia_py.ops.final_errors import CONFIG_EXIT_CODE, ENV_RANK_FAILED_FILE, RANK_CONFIG_ERROR

RUN_ID = "none"
"""torchrun's ``--rdzv-id`` when none is given: the ranks' ``TORCHELASTIC_RUN_ID``."""
SHUTDOWN_SEC = 30.0
"""How long stopped ranks get before SIGKILL (torchrun's agent: 30 s)."""
_STORE_TIMEOUT = timedelta(seconds=600)  # torch's static rendezvous
_HANDLED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's --signals-to-handle


class _Interrupted(Exception):
    """SIGINT arrived: the ranks are stopped with it (torchrun's SignalException)."""


def rank_env(env: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """``env`` as torchrun on one node with no restarts passes it to local rank ``rank``
    of ``nproc`` (torch 2.13's ``LocalElasticAgent._start_workers``; the rendezvous is
    the static one of persia_py.launcher.loopback_torchrun, on ``LOOPBACK:port``)."""
    env = dict(env)
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun sets it, with a warning
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return {**env, "TORCHELASTIC_SIGNALS_TO_HANDLE": _HANDLED_SIGNALS,
            "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": RUN_ID, "TORCHELASTIC_USE_AGENT_STORE": "True"}


class _Store:
    """torchrun's store (loopback_torchrun's): its socket listens on ``LOOPBACK:port`` from
    the start (a rank that dials it early waits in the backlog); torch is imported and
    the ``TCPStore`` made on it by :meth:`host`."""

    def __init__(self, port: int) -> None:
        self.listener = socket.create_server((LOOPBACK, port), backlog=128)
        self.port = self.listener.getsockname()[1]
        self.store: object | None = None  # held: the server lives as long as it

    def host(self) -> None:
        from torch.distributed import TCPStore

        # The store owns the descriptor from here on (libuv closes it).
        self.store = TCPStore(LOOPBACK, self.port, 1, True, _STORE_TIMEOUT,
                              multi_tenant=True, master_listen_fd=self.listener.detach(),
                              use_libuv=True)

    def close(self) -> None:
        self.listener.close()
        self.store = None


def run_ranks(script: list[str], nproc: int, env: dict[str, str], *, port: int = 0) -> int:
    """Run ``nproc`` ranks of ``script`` (its path and arguments) in the foreground, their
    store on ``LOOPBACK:port`` (0: any free port); return the node's code (the module
    docstring says which)."""
    stop_signals.on_stop_signals()  # read by the watch (persia_py/launcher/stop_signals.py)
    store = _Store(port)
    python = os.getenv("PYTHON_EXEC", sys.executable)
    with rank_failed_file() as failed_file:
        env = {**env, ENV_RANK_FAILED_FILE: failed_file}
        # Each rank dies with this wrapper, which dies with the launcher (lifeline.py).
        preexec = stop_signals.child_ignores(stop_signals.configured(), die_with_parent())
        ranks = [subprocess.Popen([python, "-u", *script],
                                  env=rank_env(env, r, nproc, store.port),
                                  start_new_session=True, preexec_fn=preexec)
                 for r in range(nproc)]
        stop_with = signal.SIGTERM
        try:
            if nproc > 1:  # they will dial it (TrainCtx does): made while they start
                store.host()
            return _watch(ranks, store, failed_file)
        except _Interrupted:
            stop_with = signal.SIGINT
            return 1
        finally:  # a second Ctrl-C does not cut the stop short: signals are only noted
            _stop(ranks, stop_with)
            store.close()


def _forward(ranks: list[subprocess.Popen], signals: list[int]) -> None:
    """SIGTERM goes to the ranks (for any stop signal but SIGINT: SIGUSR2 under Slurm,
    persia_py/launcher/stop_signals.py): one that stops cleanly on it
    (TrainCtx(stop_on_signal=True)) exits 0, and the node with it. SIGINT ends the watch,
    as it ends torchrun's."""
    for signum in signals:
        if signum == signal.SIGINT:
            raise _Interrupted
        for rank in ranks:
            if rank.returncode is None:
                _signal(rank.pid, signal.SIGTERM, group=False)


def _watch(ranks: list[subprocess.Popen], store: _Store, failed_file: str) -> int:
    """Wait for every rank to exit 0 (0) or one to fail (the code of :func:`_failed`);
    host the store once a rank dials it."""
    with selectors.DefaultSelector() as events:
        events.register(stop_signals.wakeup_fd(), selectors.EVENT_READ, "signals")
        unread = stop_signals.Unread()
        if store.store is None:
            events.register(store.listener, selectors.EVENT_READ, None)
        for rank in ranks:  # a pidfd reads as ready once its process exited
            events.register(os.pidfd_open(rank.pid), selectors.EVENT_READ, rank)
        try:
            while any(rank.returncode is None for rank in ranks):
                for key, _ in events.select(timeout=stop_signals.STOP_POLL_SEC):
                    if key.data == "signals":
                        _forward(ranks, unread.new())
                        continue
                    events.unregister(key.fileobj)
                    if key.data is None:
                        store.host()
                        continue
                    os.close(key.fd)
                    if (code := key.data.wait()) != 0:
                        return _failed(ranks.index(key.data), code, failure(failed_file))
        finally:
            for key in list(events.get_map().values()):
                if isinstance(key.data, subprocess.Popen):
                    os.close(key.fd)
    return 0


def _failed(rank: int, code: int, reason: str | None) -> int:
    """Say why the node stops after local rank ``rank`` exited with ``code``; its code."""
    if reason is not None and RANK_CONFIG_ERROR in reason:
        line = next(x for x in reason.splitlines() if RANK_CONFIG_ERROR in x)
        print(f"[nn-worker] {line}; not restarting the ranks", flush=True)
        return CONFIG_EXIT_CODE
    how = f"signal {-code}" if code < 0 else f"code {code}"
    print(f"[nn-worker] rank {rank} exited with {how}; stopping the other ranks"
          + (f". Its error: {reason}" if reason else ""), flush=True)
    return 1


def _stop(ranks: list[subprocess.Popen], sig: int) -> None:
    """Send ``sig`` to the process group of every rank still running and wait for them;
    SIGKILL the groups of those left after :data:`SHUTDOWN_SEC` (torchrun's shutdown)."""
    for rank in ranks:
        if rank.poll() is None:
            _signal(rank.pid, sig, group=True)
    deadline = time.monotonic() + SHUTDOWN_SEC
    for rank in ranks:
        try:
            rank.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(rank.pid, signal.SIGKILL, group=True)
            rank.wait()


def _signal(pid: int, sig: int, *, group: bool) -> None:
    try:
        os.killpg(pid, sig) if group else os.kill(pid, sig)
    except ProcessLookupError:
        pass

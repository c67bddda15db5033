"""``persia-launcher local``: a whole cluster on this machine, supervised.

Every role runs as its own process (its own session, so it can be stopped with all its
children). Each output line is prefixed with the role and replica. When training ends,
the data loaders are waited for and the servers stopped. The launcher exits with the
training's exit code and leaves no process behind, on Ctrl-C too; a launcher killed
outright (SIGKILL) takes every role with it, torchrun's ranks and the user's scripts
included (persia_py/launcher/lifeline.py). SIGTERM stops the NN
workers first and waits for them (an online job's ranks, ``TrainCtx(stop_on_signal=True)``,
finish their step and write a final checkpoint, then exit 0), then the other roles; a
second SIGTERM stops all at once. (The roles are stopped with ``stop_signal``: SIGTERM,
or under Slurm SIGUSR2 to each role's ``srun``: persia_py/launcher/slurm_run.py.)
A process that dies while training runs (a non-zero exit or a signal) does not stop the
job, up to ``max_restarts`` times per role, while the others wait and retry: a parameter
server is started again alone, on the same port with the same replica index, from the
checkpoint its update log starts from plus the log replayed; an embedding worker alone,
on the same port (the data loaders put the batches it lost there again); a data loader
alone, on the same port (its handover log says where it left off). Only an NN rank's
death rolls the training back to its last checkpoint (persia_py/launcher/recovery.py).
Past the limit, or when a server exits cleanly before training ended, everything stops
(the NN workers first, while the servers their final checkpoint needs still run); so does
a role that stopped on a config error (exit code 78,
:data:`persia_py.ops.start_checks.CONFIG_EXIT_CODE`), which is never restarted. A data
loader that stopped on a data error (exit code 65,
:data:`persia_py.ops.final_errors.DATA_EXIT_CODE`) is not restarted either: it ended its
stream after the batches it made, the NN workers train them and checkpoint, and the job
exits 65.

Both config files are validated before any process starts, the checkpoint folders
against the checkpoint root included. Every role gets the job
token by environment: the user's (``auth_token_file`` or ``$PERSIA_AUTH_TOKEN``), else a
new one per run, also written to ``<run dir>/auth_token`` (mode 0600) for clients started
outside the job; ``--insecure`` runs without one, and says so. Every role serves Prometheus
metrics on a free port (its ``... metrics on http://...`` line says which) unless
``--no-metrics``; rank 0 writes its JSON-lines training log into the run folder.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from persia_py.checkpoint import rewind
from persia_py.launcher import stop_signals
from persia_py.launcher.job_roles import Role
from persia_py.launcher.lifeline import Lifeline
from persia_py.launcher.processes import descendants, die_with_parent
from persia_py.launcher.role_kinds import (
    DATA_LOADER,
    EMBEDDING_WORKER,
    NN_WORKER,
    PARAMETER_SERVER,
)
from persia_py.ops import allocator
from persia_py.ops.final_errors import DATA_EXIT_CODE
from persia_py.ops.start_checks import (
    CONFIG_EXIT_CODE,
)
from persia_py.telemetry.monitoring import LauncherMetrics

_STOP_GRACE_SEC = 10.0
GRACEFUL_STOP_SEC = 300.0
"""How long SIGTERM waits for the NN workers to stop on their own (a final checkpoint
of large tables takes a while); a second SIGTERM stops everything at once."""


class GracefulStop(Exception):
    """The launcher got SIGTERM: stop the training cleanly, then the other roles."""


MAX_RESTARTS = 3
"""Restarts each role may make (``--max-restarts``): alone, or of the training
(persia_py.launcher.recovery)."""


class LocalCluster:
    """Starts, watches and stops the processes of one local job."""

    def __init__(self, roles: list[Role], env: dict[str, str], *,
                 max_restarts: int = MAX_RESTARTS, stop_signal: int = signal.SIGTERM) -> None:
        self.roles = roles
        self.env = env
        self.max_restarts = max_restarts
        self.stop_signal = stop_signal
        """What stops a role's process (``Layout.stop_signal``: SIGUSR2 to ``srun``)."""
        self._print_lock = threading.Lock()
        self._exited = threading.Event()
        self._lifeline: Lifeline | None = None
        self.metrics: LauncherMetrics | None = None
        """Restarts counted as ``persia_restarts_total{role}`` (when serving metrics)."""
        self.restart_training: Callable[[Role, str], bool] | None = None
        """Called with a role without ``restart`` that died and how; True: it restarted
        the job's training (see persia_py.launcher.recovery); None: the job stops."""

    def _pump(self, role: Role) -> None:
        assert role.process is not None and role.process.stdout is not None
        for line in role.process.stdout:
            text = line.decode(errors="replace")
            with self._print_lock:
                sys.stdout.write(f"[{role.name}] {text}")
                sys.stdout.flush()
        role.process.wait()
        self._exited.set()

    def start(self) -> None:
        for role in self.roles:
            self.spawn(role, role.command)

    def spawn(self, role: Role, command: list[str]) -> None:
        """Start ``role``'s process with ``command`` (the cluster's environment), from a
        thread that outlives it (the main thread): a server gets SIGKILL when the thread
        that started it exits (persia_py/launcher/lifeline.py)."""
        env = allocator.with_tunables(self.env)
        if role.kind is not NN_WORKER and "OMP_NUM_THREADS" not in env:
            # Servers and loaders run on threads of their own; an OpenMP pool in each of
            # them only fights the NN worker's for the same cores.
            env = {**env, "OMP_NUM_THREADS": "1"}
        if role.kind is NN_WORKER and "OMP_WAIT_POLICY" not in env:
            # On one machine the NN worker shares its cores with the servers: OpenMP threads
            # that spin while idle take CPU the servers need (docs/benchmarks.md).
            env = {**env, "OMP_WAIT_POLICY": "PASSIVE"}
        if role.reader is not None:
            role.reader.join(timeout=5.0)  # the old process's output is all printed
        if self._lifeline is None:
            self._lifeline = Lifeline()
        # Every role dies with the launcher, however it dies (persia_py/launcher/lifeline.py):
        # it watches the lifeline; one without children of its own also gets SIGKILL from
        # the kernel (a wrapper must outlive the launcher a moment, to stop its children).
        role.process = subprocess.Popen(
            command, env=self._lifeline.child_env(env), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            pass_fds=(self._lifeline.read_fd,),
            preexec_fn=None if role.kind.runs_script else die_with_parent(),
        )
        role.reader = threading.Thread(target=self._pump, args=(role,), daemon=True)
        role.reader.start()

    def _try_restart(self, role: Role, code: int) -> bool:
        """Start a role that died again, if it may be; False: the job must stop."""
        try:
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
        except ValueError:
            how = f"signal {-code}"
        if code == CONFIG_EXIT_CODE:
            self.log(f"{role.name} stopped on a config error ({how}; its message is above); "
                     "not restarting it: it would stop the same way")
            return False
        if code == DATA_EXIT_CODE and role.kind is DATA_LOADER:
            return False  # _watch ends the job once its batches are trained
        if role.restart is None:
            return self.restart_training is not None and self.restart_training(role, how)
        # Asked to exit by NN ranks that torchrun restarted (Restart, Rewind:
        # persia_py/checkpoint/rewind.py). Counted like a death: any caller with the job token may
        # ask, and must not keep the job restarting without end.
        asked = code == rewind.EXIT_CODE and role.kind in (EMBEDDING_WORKER, DATA_LOADER)
        if role.num_restarts >= self.max_restarts:
            self.log(f"{role.name} {'exited to be started again' if asked else 'died'} "
                     f"({how}) after {role.num_restarts} restarts, the limit; stopping the job")
            return False
        role.num_restarts += 1
        self.count_restart(role)
        command = role.restart()
        if asked:
            self.log(f"{role.name} exited to be started again ({how}): the training restarted "
                     "by torchrun goes back to its checkpoint; restarting it on the same port "
                     f"(restart {role.num_restarts} of {self.max_restarts})")
            self.spawn(role, command)
            return True
        source = command[command.index("--load-checkpoint") + 1] if (
            "--load-checkpoint" in command) else None
        if role.kind is EMBEDDING_WORKER:
            detail = "its batches are put there again by their data loaders"
        elif role.kind is DATA_LOADER:
            detail = "it goes on after the batches it had handed over"
        elif "--replay-update-log" in command:
            detail = ("its update log applied again to the checkpoint it starts from"
                      + (f"; else from checkpoint {source}" if source else ""))
        else:
            detail = f"from checkpoint {source}" if source else "empty: no checkpoint yet"
        self.log(f"{role.name} died ({how}); restarting it on the same port (restart "
                 f"{role.num_restarts} of {self.max_restarts}, {detail})")
        self.spawn(role, command)
        return True

    def count_restart(self, role: Role) -> None:
        if self.metrics is not None:
            self.metrics.restarts.labels(role=role.name).inc()

    def log(self, message: str) -> None:
        with self._print_lock:
            print(f"[launcher] {message}", flush=True)

    def run(self) -> int:
        """Wait for training to end or any role to fail; stop everything; return the code.
        On :class:`GracefulStop` the NN workers stop first (:meth:`stop_training`)."""
        try:
            try:
                return self._watch()
            except GracefulStop:
                return self.stop_training()
        except KeyboardInterrupt:
            self.log("interrupted; stopping every process")
            return 130
        finally:
            self.stop()

    def _watch(self) -> int:
        data_errors: list[Role] = []
        while True:
            self._exited.wait(timeout=1.0)
            self._exited.clear()
            nn = [r for r in self.roles if r.kind is NN_WORKER]
            for role in self.roles:
                code = role.started.poll()
                if code is None or role in data_errors:
                    continue
                if code == DATA_EXIT_CODE and role.kind is DATA_LOADER:
                    data_errors.append(role)
                    self.log(f"{role.name} stopped on a data error (code {code}; its message "
                             "is above) after every batch it made was trained; not restarting "
                             "it: it would stop the same way. The job ends with code "
                             f"{code}; fix or remove the input and run the same command again")
                    continue
                if code != 0:
                    if self._try_restart(role, code):
                        continue
                    self.log(f"{role.name} exited with code {code}; stopping the job")
                    return code
                if role.kind in (PARAMETER_SERVER, EMBEDDING_WORKER):
                    if role.lost is not None and role.lost() and self._try_restart(role, code):
                        continue  # its node was lost: its step's clean end is a death
                    self.log(f"{role.name} exited before training ended; stopping the job")
                    return 1
            if all(r.started.poll() == 0 for r in nn):
                return self._finish()
            if data_errors and any(r.started.poll() is None for r in self.roles
                                   if r.kind is DATA_LOADER):
                # The other loaders' streams go on: the training stops as on SIGTERM, its
                # final checkpoint holding every batch the failed loader made.
                return self.stop_training() or DATA_EXIT_CODE

    def stop_training(self) -> int:
        """SIGTERM the NN workers alone and wait for them: with
        ``TrainCtx(stop_on_signal=True)`` they finish their step, write a final checkpoint
        and exit 0. The other roles are stopped after them (the servers hold the rows
        that checkpoint reads). Returns the NN workers' exit code."""
        self.log("SIGTERM: stopping the NN workers after their current step (a final "
                 "checkpoint follows); then every other role")
        nn = [r for r in self.roles if r.kind is NN_WORKER and r.process is not None]
        for role in nn:
            if role.started.poll() is None:
                os.kill(role.started.pid, self.stop_signal)
        deadline = time.monotonic() + GRACEFUL_STOP_SEC
        codes = []
        for role in nn:
            try:
                codes.append(role.started.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.log(f"{role.name} did not stop within {GRACEFUL_STOP_SEC:.0f}s; stopping "
                         "it")
                return 1
        code = next((c for c in codes if c != 0), 0)
        self.log("training stopped" + ("" if code == 0 else f" with code {code}"))
        return code

    def supervise(self, stop: threading.Event | stop_signals.Requested) -> int:
        """Keep long-running roles (servers) up until ``stop`` is set.

        A role that dies is restarted when it may be (see ``Role.restart``); otherwise its
        exit code is returned (1 for a server that exited cleanly). 0 once ``stop`` is set.
        The roles are left running: the caller stops them (``stop()``).
        """
        while not stop.is_set():
            self._exited.wait(timeout=1.0)
            self._exited.clear()
            for role in self.roles:
                code = role.started.poll()
                if code is None or stop.is_set():
                    continue
                if code != 0 and self._try_restart(role, code):
                    continue
                self.log(f"{role.name} exited with code {code}; stopping")
                return code or 1
        return 0

    def _finish(self) -> int:
        deadline = time.monotonic() + 60.0
        for role in self.roles:
            if role.kind is DATA_LOADER:
                try:
                    code = role.started.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.log(f"{role.name} still running 60s after training ended")
                    return 1
                if code == DATA_EXIT_CODE:
                    self.log("training finished: every batch made before the data error was "
                             f"trained; the job ends with code {code}")
                    return code
                if code != 0:
                    self.log(f"{role.name} exited with code {code}")
                    return code
        self.log("training finished")
        return 0

    def stop(self, roles: list[Role] | None = None) -> None:
        """SIGTERM the processes of ``roles`` (all) and their children; SIGKILL what is
        left after a grace period. All of them: the NN workers first, while the servers
        their last step and final checkpoint need still run."""
        if roles is None:
            self._stop([r for r in self.roles if r.kind is NN_WORKER])
            self._stop([r for r in self.roles if r.kind is not NN_WORKER])
            if self._lifeline is not None:
                self._lifeline.close()  # every role is gone; a later spawn makes a new one
                self._lifeline = None
        else:
            self._stop(roles)

    def _stop(self, roles: list[Role]) -> None:
        pids = []
        for role in roles:
            if role.process is not None and role.process.poll() is None:
                pids.append(role.process.pid)
                pids.extend(descendants(role.process.pid))
        for pid in pids:
            try:
                os.kill(pid, self.stop_signal)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + _STOP_GRACE_SEC
        for role in roles:
            if role.process is None:
                continue
            try:
                role.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                # A role that outlives its grace hangs on shutdown (a bug to report, and
                # a pod that would hang as long): say so before it is killed.
                print(f"[launcher] {role.name} did not stop within {_STOP_GRACE_SEC:.0f} s "
                      "of SIGTERM; killing it", flush=True)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for role in roles:
            if role.process is not None:
                role.process.wait()
            if role.reader is not None:
                role.reader.join(timeout=5.0)

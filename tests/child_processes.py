"""The processes a test starts, as its children: a role or other command whose output the
test waits on (:class:`RoleProcess`), a server role started on a free port
(:func:`start_server`), the launcher's command line, what is left of a process's tree
(every process a test starts carries a marker in its environment:
:func:`processes_with_marker`, :func:`process_report`, :func:`kill_marked`), a role held on
a config error, and ranks spawned in a process group of their own (:func:`run_ranks`).
Finding one role's process inside a running job is :mod:`benchmarks.role_processes`."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
from checkout import ROOT


class RoleProcess:
    """A child process whose output lines are collected by a reader thread."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.marker = uuid.uuid4().hex
        full_env = dict(os.environ if env is None else env)
        full_env["PERSIA_TEST_MARKER"] = self.marker
        full_env["PYTHONUNBUFFERED"] = "1"
        self.process = subprocess.Popen(
            command, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd or ROOT,
        )
        self.lines: list[str] = []
        self._terminated = False
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.process.stdout:
            line = raw.decode(errors="replace")
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def wait_for_line(self, pattern: str, timeout: float) -> re.Match:
        """The first new output line matching ``pattern``; fails after ``timeout`` s."""
        regex = re.compile(pattern)
        try:
            while True:
                line = self._queue.get(timeout=timeout)
                if line is None:
                    raise AssertionError(f"process ended before printing {pattern!r}:\n"
                                         + self.output())
                match = regex.search(line)
                if match:
                    return match
        except queue.Empty:
            raise AssertionError(f"no line matching {pattern!r} within {timeout}s:\n"
                                 + self.output()) from None

    def wait(self, timeout: float) -> int:
        code = self.process.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def output(self) -> str:
        return "".join(self.lines[-200:])

    def interrupt(self, timeout: float = 60.0) -> int:
        """Send SIGINT (Ctrl-C) and wait up to ``timeout`` s for the exit code; fails with
        the state of every process still carrying the marker (signal masks and
        dispositions, and the launcher's Python stacks) if it has not exited."""
        self.process.send_signal(signal.SIGINT)
        try:
            return self.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {timeout:.0f} s after SIGINT:\n"
                                 + process_report(self.marker, self.process.pid)
                                 + "\n" + self.output()) from None

    def finish(self, timeout: float) -> str:
        """Wait up to ``timeout`` s for the process to exit, stop whatever is left, and
        return all its output; fails (showing the output's end) unless it exited 0."""
        try:
            code = self.wait(timeout=timeout)
        finally:
            self.stop()
        out = "".join(self.lines)
        assert code == 0, out[-20000:]
        return out

    def terminate(self) -> None:
        """SIGTERM the process's group, once, without waiting (:meth:`stop` waits)."""
        if self.process.poll() is None and not self._terminated:
            self._terminated = True
            os.killpg(self.process.pid, signal.SIGTERM)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=15)
        kill_marked(self.marker)


def stop_all(procs: Sequence[RoleProcess]) -> None:
    """Stop every one of ``procs``: all are sent SIGTERM first, so that they shut down
    side by side (a server's shutdown waits out the calls in flight) rather than in
    turn; then each is waited for as :meth:`RoleProcess.stop` does."""
    try:
        for proc in procs:
            proc.terminate()
    finally:
        for proc in procs:
            proc.stop()


def processes_with_marker(marker: str) -> list[int]:
    """PIDs of live processes whose environment carries ``PERSIA_TEST_MARKER=marker``."""
    needle = f"PERSIA_TEST_MARKER={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    with open(f"/proc/{entry}/stat") as s:
                        if s.read().split(") ")[1].startswith("Z"):
                            continue  # a zombie has exited; its parent just has not reaped it
                    found.append(int(entry))
        except OSError:
            continue
    return found


def process_report(marker: str, stacks_of: int | None = None) -> str:
    """Each live process carrying ``marker``: its command line, state and signal masks;
    then ``stacks_of``'s Python stacks (py-spy), for a process that did not stop."""
    lines = []
    for pid in processes_with_marker(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":\t", 1) for line in f.read().splitlines()
                              if ":\t" in line)
        except OSError:
            continue
        state = " ".join(f"{k}={fields.get(k, '?').strip()}"
                         for k in ("State", "PPid", "SigBlk", "SigIgn", "SigCgt", "SigPnd",
                                   "ShdPnd"))
        lines.append(f"{pid} {state} {argv}")
    spy = Path(sys.executable).with_name("py-spy")
    if stacks_of is not None and spy.exists():
        done = subprocess.run([str(spy), "dump", "--pid", str(stacks_of)], capture_output=True,
                              text=True, timeout=30)
        lines.append(done.stdout + done.stderr)
    return "\n".join(lines)


def kill_marked(marker: str) -> None:
    for pid in processes_with_marker(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


HOLD_CHECK_SEC = 1.0
"""How long a held role is watched for an exit after it said it holds."""


def held_until_sigterm(job: RoleProcess, command: str) -> None:
    """``job`` (``persia-launcher COMMAND ...``) says it holds on a config error, does not
    exit, and exits with the config exit code on SIGTERM."""
    from persia_py.ops.start_checks import CONFIG_EXIT_CODE

    job.wait_for_line(rf"persia-launcher {command}: stopped on a config error \(code 78; its "
                      r"message is above\); holding instead of exiting", timeout=120)
    with pytest.raises(subprocess.TimeoutExpired):
        job.process.wait(timeout=HOLD_CHECK_SEC)
    assert job.process.poll() is None, job.output()
    job.process.send_signal(signal.SIGTERM)
    assert job.wait(timeout=30) == CONFIG_EXIT_CODE, job.output()
    assert processes_with_marker(job.marker) == []


def launcher_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "persia_py.launcher.cli", *args]


def start_server(role: str, *args: str, env: dict[str, str] | None = None,
                 port: int | str = 0) -> tuple[RoleProcess, int]:
    """Start a server role on a free port (port 0), or on ``port`` (a restart on the
    port it had); returns (process, port)."""
    proc = RoleProcess(launcher_command(role, "--port", str(port), *args), env=env)
    try:
        match = proc.wait_for_line(r"on port (\d+) ready", timeout=120)
    except BaseException:
        proc.stop()
        raise
    return proc, int(match.group(1))


def run_ranks(target, *args, world_size: int = 2, timeout: float = 240) -> None:
    """Run ``target(rank, port, *args)`` in ``world_size`` spawned processes (``port``: a
    free one for their process group); fails on a non-zero exit or a rank still running
    after ``timeout`` s, and leaves no process behind."""
    import multiprocessing

    from persia_py.launcher.ports import free_ports

    [port] = free_ports(1, "127.0.0.1")
    spawn = multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=target, args=(r, port, *args)) for r in range(world_size)]
    for p in ranks:
        p.start()
    try:
        for p in ranks:
            p.join(timeout=timeout)
            assert p.exitcode == 0, f"rank exit code {p.exitcode}"
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
                p.join(timeout=30)

"""``$PERSIA_STOP_SIGNALS`` (persia_py/launcher/stop_signals.py): the signals a supervisor
stops a role with. Under Slurm the servers' steps stop on SIGUSR2 alone and ignore Slurm's
SIGTERM, which reaches every process of the job at once, and what they start ignores
SIGUSR2, which reaches every process of the step."""

from __future__ import annotations

import os
import signal
import sys
import textwrap

import pytest
from conftest import RoleProcess

from persia_py.launcher import stop_signals

pytestmark = pytest.mark.processes

_ROLE = textwrap.dedent("""
    import signal, subprocess, sys
    from persia_py.launcher import stop_signals
    stop_signals.on_stop_signals()
    # A child as a role starts one (a data loader's script, torchrun): it reads until
    # its parent closes its stdin, unless a signal ends it first.
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
        preexec_fn=stop_signals.child_ignores(stop_signals.configured()))
    print("ready", flush=True)
    stop_signals.wait_for_stop_signal()
    print("taken", [signal.Signals(s).name for s in stop_signals.taken()], flush=True)
    child.stdin.close()
    print("child exited", child.wait(), flush=True)
""")


def _role(stop: str | None) -> RoleProcess:
    env = {k: v for k, v in os.environ.items() if k != stop_signals.ENV_STOP_SIGNALS}
    if stop is not None:
        env[stop_signals.ENV_STOP_SIGNALS] = stop
    proc = RoleProcess([sys.executable, "-c", _ROLE], env=env)
    proc.wait_for_line("ready", timeout=60)
    return proc


def test_a_server_step_under_slurm_ignores_sigterm_and_stops_on_sigusr2() -> None:
    proc = _role("SIGUSR2,SIGINT")
    try:
        # Slurm's SIGTERM, then the supervisor's SIGUSR2, each to the whole step.
        os.killpg(proc.process.pid, signal.SIGTERM)
        os.killpg(proc.process.pid, signal.SIGUSR2)
        assert proc.wait(timeout=60) == 0, proc.output()
        assert "taken ['SIGUSR2']" in proc.output(), proc.output()
        # The child ignored both: it ended when its stdin closed.
        assert "child exited 0" in proc.output(), proc.output()
    finally:
        proc.stop()


def test_by_default_sigterm_stops_a_role() -> None:
    proc = _role(None)
    try:
        os.kill(proc.process.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.output()
        assert "taken ['SIGTERM']" in proc.output(), proc.output()
        assert "child exited 0" in proc.output(), proc.output()
    finally:
        proc.stop()


def test_an_unknown_stop_signal_is_refused_naming_it() -> None:
    assert stop_signals.configured({stop_signals.ENV_STOP_SIGNALS: "sigusr2, SIGINT"}) == (
        signal.SIGUSR2, signal.SIGINT)
    with pytest.raises(SystemExit, match=r"PERSIA_STOP_SIGNALS='SIGTERM,SIGUSR3': 'SIGUSR3'"):
        stop_signals.configured({stop_signals.ENV_STOP_SIGNALS: "SIGTERM,SIGUSR3"})
    with pytest.raises(SystemExit, match="'SIGKILL' is not a signal a process can take"):
        stop_signals.configured({stop_signals.ENV_STOP_SIGNALS: "SIGKILL"})

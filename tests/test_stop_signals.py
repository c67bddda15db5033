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
from child_processes import RoleProcess

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


@pytest.mark.parametrize("stop, sent, taken", [
    # A server's step under Slurm: Slurm's SIGTERM, then the supervisor's SIGUSR2, each to
    # every process of the step.
    ("SIGUSR2,SIGINT", (signal.SIGTERM, signal.SIGUSR2), "['SIGUSR2']"),
    # Anywhere else: SIGTERM, to the role (which would pass it on).
    (None, (signal.SIGTERM,), "['SIGTERM']"),
])
def test_a_role_stops_on_its_stop_signals_alone(stop: str | None, sent: tuple[int, ...],
                                                taken: str) -> None:
    proc = _role(stop)
    try:
        for sig in sent:
            if stop is None:
                os.kill(proc.process.pid, sig)
            else:
                os.killpg(proc.process.pid, sig)
        assert proc.wait(timeout=60) == 0, proc.output()
        assert f"taken {taken}" in proc.output(), proc.output()
        # The child took none of them (ignored, or left to its parent): it ended when its
        # stdin closed.
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

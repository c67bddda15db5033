"""``persia-launcher nn-worker`` with one rank on one node and no torchrun restarts starts
it itself (persia_py/launcher/local_ranks.py): it gets what torchrun would give it and a
process group meets on the wrapper's store. ``run_ranks`` with several ranks (which the
CLI leaves to torchrun for now, see roles.py): a failure, a config error, SIGINT and
SIGTERM end the node as under torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from child_processes import RoleProcess, launcher_command

from persia_py.ops.final_errors import CONFIG_EXIT_CODE

pytestmark = pytest.mark.processes

DUMP = """
import json, os, sys
with open(os.path.join(sys.argv[1], f"rank-{os.environ['RANK']}.json"), "w") as f:
    json.dump({"env": dict(os.environ), "cmdline": open("/proc/self/cmdline").read(),
               "session_leader": os.getsid(0) == os.getpid()}, f)
if sys.argv[2:] != ["--process-group"]:
    sys.exit(0)
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
print(f"rank {dist.get_rank()} sum {total.item():.0f}", flush=True)
dist.destroy_process_group()
"""

SIGNALS = """
import os, signal, sys, threading
rank, got = os.environ["RANK"], threading.Event()
def say(line):  # in one write: unbuffered, print writes the newline apart, and two
    sys.stdout.write(line + "\\n")  # ranks' lines could interleave on the shared pipe
    sys.stdout.flush()
def on(signum, _frame):
    say(f"rank {rank} got {signal.Signals(signum).name}")
    got.set()
signal.signal(signal.SIGTERM, on)
signal.signal(signal.SIGINT, on)
say(f"rank {rank} ready")
got.wait(120)
"""

FAILS = """
import os, sys, threading
if os.environ["RANK"] == "1":
    {failure}
threading.Event().wait(120)  # stopped by the node
"""


def _script(tmp_path, text: str) -> str:
    path = tmp_path / "rank.py"
    path.write_text(text)
    return str(path)


def _dump(tmp_path, how: str, nproc: int, *args: str) -> list[dict]:
    """Run DUMP's ranks under ``nn-worker`` (``how``: "torchrun", with restarts, or
    "direct"); what each rank saw."""
    (tmp_path / how).mkdir()
    flags = ["--max-restarts", "1"] if how == "torchrun" else []
    done = subprocess.run(launcher_command("nn-worker", "--insecure", "--nproc-per-node",
                                           str(nproc), *flags, _script(tmp_path, DUMP),
                                           str(tmp_path / how), *args),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    if args:
        for rank in range(nproc):
            assert f"rank {rank} sum {nproc * (nproc + 1) // 2}" in done.stdout, done.stdout
    return [json.loads((tmp_path / how / f"rank-{r}.json").read_text()) for r in range(nproc)]


def _run_ranks(nproc: int, script: str) -> list[str]:
    """A command running ``script``'s ``nproc`` ranks through ``run_ranks`` itself."""
    return [sys.executable, "-c", "import os, sys; from persia_py.launcher.local_ranks "
            "import run_ranks; from persia_py.ops.final_errors import ENV_FINAL_CONFIG_ERRORS; "
            "sys.exit(run_ranks(sys.argv[2:], int(sys.argv[1]), "
            "{**os.environ, ENV_FINAL_CONFIG_ERRORS: '1'}))", str(nproc), script]


def test_the_rank_gets_what_torchrun_gives_it(tmp_path) -> None:
    dumps = {how: _dump(tmp_path, how, 1) for how in ("torchrun", "direct")}
    # Where they differ: torchrun's own, not the job's, and what --max-restarts says.
    differ = {"MASTER_PORT", "PERSIA_RANK_FAILED_FILE", "TORCHELASTIC_ERROR_FILE",
              "TORCHELASTIC_MAX_RESTARTS"}
    for torchrun, direct in zip(dumps["torchrun"], dumps["direct"]):
        assert {k: v for k, v in direct["env"].items() if k not in differ} == \
            {k: v for k, v in torchrun["env"].items() if k not in differ}
        assert direct["env"]["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert "TORCHELASTIC_ERROR_FILE" not in direct["env"]
        # python -u SCRIPT ARGS
        assert direct["cmdline"].split("\0")[:3] == torchrun["cmdline"].split("\0")[:3]
        assert direct["cmdline"].split("\0")[1] == "-u"
        assert direct["session_leader"] and torchrun["session_leader"]


def test_a_single_rank_gets_the_store_once_it_dials_it(tmp_path) -> None:
    """Several ranks get their store as they start (tests/test_ports.py sees it on
    loopback); a single one, which TrainCtx makes no process group for, only if it dials
    it."""
    _dump(tmp_path, "direct", 1, "--process-group")


@pytest.mark.parametrize("failure, code, line", [
    ("sys.exit(5)", 1, r"\[nn-worker\] rank 1 exited with code 5; stopping the other ranks"),
    ("from persia_py.config import ConfigError\n    raise ConfigError('own.yml: x: unknown key')",
     CONFIG_EXIT_CODE, r"\[nn-worker\] rank 1: stopped on a config error: ConfigError: "
     r"own.yml: x: unknown key; not restarting the ranks"),
])
def test_a_failed_rank_stops_the_others_at_once(tmp_path, failure: str, code: int,
                                                line: str) -> None:
    """The other rank is stopped (SIGTERM) as torchrun stops it; the node's code is
    torchrun's 1, or 78 for a config error before any progress: the rank that reported
    it exits at once, since no restart follows."""
    script = _script(tmp_path, FAILS.format(failure=failure))
    job = RoleProcess(_run_ranks(2, script))
    try:
        start = time.monotonic()
        assert job.wait(timeout=120) == code, job.output()
        assert time.monotonic() - start < 25, job.output()  # not the rank's 30 s wait
        job.wait_for_line(line, timeout=1)
    finally:
        job.stop()


@pytest.mark.parametrize("sig, code", [("SIGINT", 1), ("SIGTERM", 0)])
def test_a_signal_reaches_every_rank(tmp_path, sig: str, code: int) -> None:
    """SIGINT stops the ranks with SIGINT and the node with torchrun's code 1; SIGTERM is
    passed on to the ranks, which stop cleanly: the node exits 0."""
    import signal

    script = _script(tmp_path, SIGNALS)
    job = RoleProcess(_run_ranks(2, script))
    try:
        for _ in range(2):
            job.wait_for_line(r"rank \d ready", timeout=120)
        job.process.send_signal(getattr(signal, sig))
        assert job.wait(timeout=60) == code, job.output()
        for rank in range(2):
            assert f"rank {rank} got {sig}" in job.output(), job.output()
    finally:
        job.stop()


def test_nproc_below_one_is_refused() -> None:
    done = subprocess.run(launcher_command("nn-worker", "--insecure", "--nproc-per-node", "0",
                                           "train.py"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == CONFIG_EXIT_CODE, done.stderr
    assert "--nproc-per-node must be at least 1" in done.stderr

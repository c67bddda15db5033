"""Config errors are refused at start, and a role that stops on one is never restarted.

* ``persia-launcher local`` refuses a checkpoint folder outside the checkpoint root before
  it starts any process (docs/online_training.md's own example once trained until its
  first periodic checkpoint, failed there, and was restarted three times), with exit code
  78; so do the roles it starts, ``embedding-parameter-server`` and ``nn-worker`` (before
  torchrun).
* ``LocalCluster`` takes a role's exit code 78 as final: no restart, the job stops with it.
* A config error ``TrainCtx`` finds as the user's script starts does the same: the node's
  launcher stops torchrun and exits 78.
* With ``--hold-on-config-error`` (what ``persia-launcher k8s`` gives the roles of its
  StatefulSets, which Kubernetes restarts whatever their exit code), a role that would
  exit 78 says so and holds until SIGTERM, then exits 78.

A folder the role's user cannot write: tests/test_unwritable_folders.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
from checkout import EXAMPLE
from child_processes import RoleProcess, held_until_sigterm, launcher_command, processes_with_marker

from persia_py.launcher.local import LocalCluster, Role
from persia_py.launcher.role_kinds import NN_WORKER
from persia_py.ops.start_checks import CONFIG_EXIT_CODE

pytestmark = pytest.mark.processes

OUTSIDE = "/data/job/ckpt"
"""docs/online_training.md's example folder, outside any test's checkpoint root."""


def _bad_config(tmp_path) -> str:
    path = tmp_path / "global_config.yml"
    path.write_text(textwrap.dedent(f"""
        checkpoint_config:
          root: {tmp_path}
          dir: {OUTSIDE}
          every_steps: 1000
    """))
    return str(path)


def _refusal(tmp_path) -> str:
    return (rf"config error: checkpoint_config.dir: '{OUTSIDE}' lies outside the checkpoint "
            rf"root {tmp_path.resolve()} \(checkpoint_config.root\); it must be the root or a "
            r"folder directly in it")


def test_local_refuses_a_checkpoint_folder_outside_the_root_before_starting(tmp_path) -> None:
    job = RoleProcess(launcher_command(
        "local", "--nn-worker", str(EXAMPLE / "train.py"),
        "--data-loader", str(EXAMPLE / "data_loader.py"),
        "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
        "--global-config", _bad_config(tmp_path), "--run-dir", str(tmp_path / "run")))
    try:
        assert job.wait(timeout=60) == CONFIG_EXIT_CODE, job.output()
        out = job.output()
        assert "persia-launcher local: " in out and ("[ps-0]" not in out), out
        assert re.search(_refusal(tmp_path), out), out
        assert not (tmp_path / "run").exists()
        assert processes_with_marker(job.marker) == []
    finally:
        job.stop()


@pytest.mark.parametrize("role", [
    ["embedding-parameter-server"],
    ["nn-worker", str(EXAMPLE / "train.py")],  # before torchrun starts a rank
])
def test_a_role_refuses_it_with_the_config_exit_code(tmp_path, role: list[str]) -> None:
    job = RoleProcess(launcher_command(
        role[0], "--global-config", _bad_config(tmp_path),
        "--embedding-config", str(EXAMPLE / "embedding_config.yml"), *role[1:]))
    try:
        assert job.wait(timeout=60) == CONFIG_EXIT_CODE, job.output()
        assert re.search(_refusal(tmp_path), job.output()), job.output()
        assert "holding" not in job.output(), job.output()  # without --hold-on-config-error
    finally:
        job.stop()


_EMBEDDING = ["--embedding-config", str(EXAMPLE / "embedding_config.yml")]


@pytest.mark.parametrize("args,refusal", [
    (["embedding-parameter-server", *_EMBEDDING, "--replay-update-log"],
     "--replay-update-log needs --update-log DIR"),
    (["embedding-parameter-server", *_EMBEDDING, "--follow-increments", "/tmp/increments"],
     r"--follow-increments needs --inference \(a serving replica\)"),
    (["embedding-parameter-server"], r"--embedding-config \(or PERSIA_EMBEDDING_CONFIG\) is "
                                     "required"),
    (["embedding-worker", *_EMBEDDING], r"--ps-addrs \(or PERSIA_PS_ADDRS\) is required"),
    (["data-loader", "--replay-handovers", str(EXAMPLE / "data_loader.py")],
     "--replay-handovers needs --handover-log FILE"),
])
def test_flags_that_cannot_work_are_config_errors(args: list[str], refusal: str) -> None:
    """A restart would meet them again: final, as a bad config key is."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PERSIA_PS_ADDRS", "PERSIA_EMBEDDING_CONFIG")}
    done = subprocess.run(launcher_command(*args), env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == CONFIG_EXIT_CODE, done.stderr
    assert re.search(rf"persia-launcher {args[0]}: config error: {refusal}", done.stderr), \
        done.stderr


def _bad_embedding_config(tmp_path) -> str:
    path = tmp_path / "embedding_config.yml"
    path.write_text("slots_config:\n  a:\n    dimm: 8\n")
    return str(path)


@pytest.mark.parametrize("role,config", [
    (["embedding-parameter-server"], "global"),  # its checkpoint folder outside the root
    (["embedding-worker", "--ps-addrs", "127.0.0.1:1"], "embedding"),  # a misspelled key
])
def test_a_role_told_to_hold_on_a_config_error_waits_for_sigterm_then_exits_78(
        tmp_path, role: list[str], config: str) -> None:
    """A StatefulSet would restart the role into the same error: it holds instead."""
    if config == "global":
        configs = ["--global-config", _bad_config(tmp_path),
                   "--embedding-config", str(EXAMPLE / "embedding_config.yml")]
        refusal = _refusal(tmp_path)
    else:
        configs = ["--embedding-config", _bad_embedding_config(tmp_path)]
        refusal = r"config error: .*slots_config.a.dimm: unknown key .*; did you mean 'dim'\?"
    job = RoleProcess(launcher_command(role[0], "--hold-on-config-error", "--port", "0",
                                       *configs, *role[1:]))
    try:
        held_until_sigterm(job, role[0])
        out = job.output()
        assert re.search(refusal, out), out
        assert "ready" not in out, out
    finally:
        job.stop()


def test_a_role_stopped_by_a_config_error_is_not_restarted(capsys) -> None:
    """A parameter server (restartable) that exits 78 stops the job with 78 at once; the
    NN worker beside it, still running, is stopped."""
    stopped_by_config = [sys.executable, "-c", f"import sys; sys.exit({CONFIG_EXIT_CODE})"]
    waiting = [sys.executable, "-c", "import signal; signal.pause()"]
    ps = Role("ps-0", stopped_by_config)
    restarts = []
    ps.restart = lambda: restarts.append(1) or stopped_by_config
    cluster = LocalCluster([ps, Role("nn-worker", waiting, kind=NN_WORKER)],
                           dict(os.environ))
    cluster.restart_training = lambda role, how: restarts.append(role) or True
    cluster.start()
    assert cluster.run() == CONFIG_EXIT_CODE
    assert restarts == [] and ps.num_restarts == 0
    assert "ps-0 stopped on a config error (code 78; its message is above); not restarting " \
           "it" in capsys.readouterr().out


_SCRIPT = """
import torch
from persia_py.ctx import TrainCtx
from persia_py.embedding.optim import SGD

model = torch.nn.Linear(2, 1)
with TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1),
              dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1), {}):
    raise AssertionError("TrainCtx started")
"""


@pytest.mark.parametrize("argument,refusal", [
    # A rule TrainCtx checks against the global config (no checkpoint_config.dir).
    ("stop_on_signal=True", r"ConfigError: checkpoint_config.dir: required with "
                            r"TrainCtx\(stop_on_signal=True\)"),
    # The embedding settings given as a mapping of keys, not an EmbeddingConfig.
    ("embedding_config={'seed': 1}", r"TypeError: TrainCtx\(embedding_config=...\): expected "
                                     r"a persia_py.embedding.EmbeddingConfig or None, got dict"),
])
def test_a_config_error_found_by_train_ctx_stops_the_job_with_the_config_exit_code(
        tmp_path, argument: str, refusal: str) -> None:
    """Refused by TrainCtx as the script starts: the rank reports it, the node's launcher
    stops torchrun (which would restart the ranks into it) with code 78, and `local`
    stops the job with it, restarting nothing."""
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.format(argument))
    job = RoleProcess(launcher_command(
        "local", "--nn-worker", str(script),
        "--data-loader", str(EXAMPLE / "data_loader.py"),
        "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
        "--run-dir", str(tmp_path / "run"), "--no-metrics"))
    try:
        assert job.wait(timeout=180) == CONFIG_EXIT_CODE, job.output()
        out = job.output()
        assert re.search(r"\[nn-worker\] rank 0: stopped on a config error: " + refusal, out), out
        assert "nn-worker stopped on a config error (code 78; its message is above); not " \
               "restarting it" in out, out
        assert out.count("stopped on a config error: ") == 1, out  # one start of the ranks
        assert "AssertionError: TrainCtx started" not in out and "(restart " not in out, out
        assert processes_with_marker(job.marker) == []
    finally:
        job.stop()


_READS_A_BAD_CONFIG = """
print("the script started", flush=True)
from persia_py.config import load_global_config

load_global_config({path!r})
raise AssertionError("the bad config was taken")
"""


def _script_reading_a_bad_config(tmp_path) -> tuple[str, str]:
    """A user script that reads a config of its own with persia_py's loader before making
    any context; the config misspells a key. Returns (script, the ConfigError's message)."""
    config = tmp_path / "own_config.yml"
    config.write_text("common_config:\n  rpc_timeout_secs: 5\n")
    script = tmp_path / "reads_a_bad_config.py"
    script.write_text(_READS_A_BAD_CONFIG.format(path=str(config)))
    refusal = (rf"ConfigError: {re.escape(str(config))}: common_config.rpc_timeout_secs: "
               r"unknown key .*; did you mean 'rpc_timeout_sec'\?")
    return str(script), refusal


@pytest.mark.parametrize("nn_restarts", ["launcher", "torchrun"])
def test_a_config_error_of_the_training_script_before_train_ctx_is_final(
        tmp_path, nn_restarts: str) -> None:
    """The rank stops on a ConfigError before any TrainCtx (or progress): it reports it,
    and neither torchrun nor `local` starts the script again."""
    script, refusal = _script_reading_a_bad_config(tmp_path)
    job = RoleProcess(launcher_command(
        "local", "--nn-worker", script, "--data-loader", str(EXAMPLE / "data_loader.py"),
        "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
        "--nn-restarts", nn_restarts, "--run-dir", str(tmp_path / "run"), "--no-metrics"))
    try:
        assert job.wait(timeout=180) == CONFIG_EXIT_CODE, job.output()
        out = job.output()
        assert re.search(r"\[nn-worker\] rank 0: stopped on a config error: " + refusal
                         + r"; not restarting the ranks", out), out
        assert "nn-worker stopped on a config error (code 78; its message is above); not " \
               "restarting it" in out, out
        assert out.count("[nn-worker] the script started") == 1, out  # started once
        assert "the bad config was taken" not in out and "(restart " not in out, out
        assert processes_with_marker(job.marker) == []
    finally:
        job.stop()


def test_a_config_error_of_a_data_loader_script_before_its_first_batch_is_final(
        tmp_path) -> None:
    """A loader script that stops on a ConfigError before sending a batch exits 78: `local`
    does not restart it (it would stop the same way) and stops the job with 78."""
    script, refusal = _script_reading_a_bad_config(tmp_path)
    job = RoleProcess(launcher_command(
        "local", "--nn-worker", str(EXAMPLE / "train.py"), "--data-loader", script,
        "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
        "--run-dir", str(tmp_path / "run"), "--no-metrics"))
    try:
        assert job.wait(timeout=180) == CONFIG_EXIT_CODE, job.output()
        out = job.output()
        assert re.search(r"\[data-loader-0\] persia_py.config.strict." + refusal, out), out
        assert "data-loader-0 stopped on a config error (code 78; its message is above); " \
               "not restarting it" in out, out
        assert out.count("[data-loader-0] the script started") == 1, out
        assert "(restart " not in out, out
        assert processes_with_marker(job.marker) == []
    finally:
        job.stop()


def test_a_data_loader_told_to_hold_holds_when_its_script_stops_on_a_config_error(
        tmp_path) -> None:
    """The loader's script exits 78 (a ConfigError before its first batch): its role
    holds instead of exiting with it, and exits 78 on SIGTERM."""
    script, refusal = _script_reading_a_bad_config(tmp_path)
    job = RoleProcess(launcher_command(
        "data-loader", "--hold-on-config-error", "--port", "0",
        "--embedding-config", str(EXAMPLE / "embedding_config.yml"), script))
    try:
        held_until_sigterm(job, "data-loader")
        out = job.output()
        assert re.search(r"persia_py.config.strict." + refusal, out), out
        assert out.count("the script started") == 1, out
        assert "the bad config was taken" not in out, out
    finally:
        job.stop()

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
* A folder the job's user cannot write (a checkpoint or export folder, the run folder, a
  log's folder, a loader's position log) is refused the same way, by ``local`` before it
  starts anything and by each role for what it writes, naming the folder, its key or flag
  and the user: not a PermissionError at the first write, restarted into again.
"""

from __future__ import annotations

import dataclasses
import os
import pwd
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import EXAMPLE, RoleProcess, launcher_command, processes_with_marker

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


def _holding(command: str) -> str:
    return (rf"persia-launcher {command}: stopped on a config error \(code 78; its message is "
            r"above\); holding instead of exiting")


HOLD_CHECK_SEC = 1.0
"""How long a held role is watched for an exit after it said it holds."""


def _held_until_sigterm(job: RoleProcess, command: str) -> None:
    """``job`` says it holds on a config error, does not exit, and exits 78 on SIGTERM."""
    job.wait_for_line(_holding(command), timeout=120)
    with pytest.raises(subprocess.TimeoutExpired):
        job.process.wait(timeout=HOLD_CHECK_SEC)
    assert job.process.poll() is None, job.output()
    job.process.send_signal(signal.SIGTERM)
    assert job.wait(timeout=30) == CONFIG_EXIT_CODE, job.output()
    assert processes_with_marker(job.marker) == []


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
        _held_until_sigterm(job, role[0])
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
        _held_until_sigterm(job, "data-loader")
        out = job.output()
        assert re.search(r"persia_py.config.strict." + refusal, out), out
        assert out.count("the script started") == 1, out
        assert "the bad config was taken" not in out, out
    finally:
        job.stop()


# -- folders the role's user cannot write -------------------------------------------------

_READ_ONLY = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'
"""``unshare --mount sh -c _READ_ONLY FOLDER COMMAND...``: COMMAND with FOLDER read-only."""


@dataclasses.dataclass
class Unwritable:
    """A folder the role may write (``base``) holding one it may not (``locked``, which
    exists), and how to start a role so. The tests run as root, whom no mode bit stops:
    as root, a role runs in a mount namespace of its own where ``locked`` is a read-only
    bind mount of itself (what an unwritable volume does, whoever the user); as
    another user, ``locked`` has mode 0555."""

    base: Path
    locked: Path
    prefix: list[str]
    user: str
    """The role's user as the message names it, as a pattern."""
    why: str
    """Why a write into ``locked`` fails, as the message says it."""

    def command(self, *args: str) -> list[str]:
        return [*self.prefix, *launcher_command(*args)]


@pytest.fixture
def unwritable(tmp_path: Path) -> Iterator[Unwritable]:
    locked = tmp_path / "locked"
    locked.mkdir()
    uid = os.geteuid()
    user = re.escape(f"user {pwd.getpwuid(uid).pw_name} (uid {uid})")
    if uid != 0:
        os.chmod(locked, 0o555)
        try:
            yield Unwritable(tmp_path, locked, [], user, "Permission denied")
        finally:
            os.chmod(locked, 0o755)
        return
    prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _READ_ONLY,
              str(locked)]
    try:
        done = subprocess.run([*prefix, "touch", str(locked / "probe")], capture_output=True,
                              text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no unshare(1) here to make a folder read-only for root")
    if "Read-only file system" not in done.stderr:
        pytest.skip(f"no read-only bind mount in a mount namespace here: {done.stderr[-300:]}")
    yield Unwritable(tmp_path, locked, prefix, user, "Read-only file system")


def _cannot_write(source: str, path: Path, unwritable: Unwritable, problem: str) -> str:
    """The message's line for ``path`` (from ``source``), as a pattern; ``problem``: what
    failed, before the reason."""
    return (rf"{re.escape(source)}: '{re.escape(str(path))}' cannot be written by "
            rf"{unwritable.user}: {re.escape(problem)} \({unwritable.why}\)")


def _global_config(folder: Path, **keys: object) -> str:
    """A global config in ``folder`` whose checkpoint root is ``folder``."""
    path = folder / "global_config.yml"
    lines = "".join(f"  {key}: {value}\n" for key, value in {"root": folder, **keys}.items())
    path.write_text(f"checkpoint_config:\n{lines}")
    return str(path)


_MADE_HERE = "no file can be made in it"
_MADE_IN = "it does not exist, and no folder can be made in '{}'"
_LOG_IN = "no file can be made in its folder '{}'"


@pytest.mark.parametrize("case", ["incremental_dir", "dir", "dense_export_dir", "run folder"])
def test_local_refuses_a_folder_it_cannot_write_before_starting(
        unwritable: Unwritable, case: str) -> None:
    """Issue 40's report: `ckpt/inc` could not be made; every parameter server stopped on
    a PermissionError as it started, was restarted three times, and the job exited 1.
    Now `local` names the folder, its key and the user, and starts nothing."""
    base, locked, run_dir = unwritable.base, unwritable.locked, unwritable.base / "run"
    keys: dict[str, object] = {"dir": base / "ckpt", "every_steps": 1000}
    if case == "incremental_dir":
        keys.update(incremental_dir=locked / "inc", incremental_every_sec=10)
        line = _cannot_write("checkpoint_config.incremental_dir", locked / "inc", unwritable,
                             _MADE_IN.format(locked))
    elif case == "dir":
        keys.update(dir=locked)
        line = _cannot_write("checkpoint_config.dir", locked, unwritable, _MADE_HERE)
    elif case == "dense_export_dir":
        keys.update(dense_export_dir=locked / "dense", dense_export_every_steps=100)
        line = _cannot_write("checkpoint_config.dense_export_dir", locked / "dense",
                             unwritable, _MADE_IN.format(locked))
    else:
        run_dir = locked / "run"
        line = _cannot_write("--run-dir", run_dir, unwritable, _MADE_IN.format(locked))
    job = RoleProcess(unwritable.command(
        "local", "--nn-worker", str(EXAMPLE / "train.py"),
        "--data-loader", str(EXAMPLE / "data_loader.py"),
        "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
        "--global-config", _global_config(base, **keys), "--run-dir", str(run_dir),
        "--no-metrics"))
    try:
        assert job.wait(timeout=60) == CONFIG_EXIT_CODE, job.output()
        out = job.output()
        assert re.search(r"persia-launcher local: config error: " + line, out), out
        assert "The job writes there: make it writable for that user" in out, out
        assert "[ps-0]" not in out and "Traceback" not in out, out
        assert not run_dir.exists() and os.listdir(locked) == []
        assert processes_with_marker(job.marker) == []
    finally:
        job.stop()


@pytest.mark.parametrize("case", ["incremental_dir", "update log", "nn-worker dir",
                                  "train log", "handover log"])
def test_each_role_refuses_a_folder_it_writes_and_cannot(
        unwritable: Unwritable, case: str) -> None:
    """Each role tries what it writes itself, as the user it runs as (on Kubernetes no
    `local` tried it before): exit 78 before it serves or starts its script."""
    base, locked = unwritable.base, unwritable.locked
    script = base / "script.py"
    script.write_text('print("the script started", flush=True)\n')
    keys: dict[str, object] = {}
    if case == "incremental_dir":  # the report's folder
        keys.update(dir=base / "ckpt", incremental_dir=locked / "inc",
                    incremental_every_sec=10)
        role = ["embedding-parameter-server", "--port", "0"]
        line = _cannot_write("checkpoint_config.incremental_dir", locked / "inc", unwritable,
                             _MADE_IN.format(locked))
    elif case == "update log":
        role = ["embedding-parameter-server", "--port", "0", "--update-log", str(locked)]
        line = _cannot_write("--update-log", locked, unwritable, _MADE_HERE)
    elif case == "nn-worker dir":
        keys.update(dir=locked, every_steps=1000)
        role = ["nn-worker", "--train-log", str(base / "train_log.jsonl"), str(script)]
        line = _cannot_write("checkpoint_config.dir", locked, unwritable, _MADE_HERE)
    elif case == "train log":
        role = ["nn-worker", "--train-log", str(locked / "train_log.jsonl"), str(script)]
        line = _cannot_write("--train-log", locked / "train_log.jsonl", unwritable,
                             _LOG_IN.format(locked))
    else:
        log = locked / "logs" / "handovers.log"
        role = ["data-loader", "--port", "0", "--handover-log", str(log), str(script)]
        line = _cannot_write("--handover-log", log, unwritable,
                             f"its folder '{log.parent}' does not exist, and no folder can "
                             f"be made in '{locked}'")
    env = {k: v for k, v in os.environ.items() if k != "PERSIA_TRAIN_LOG"}
    job = RoleProcess(unwritable.command(
        role[0], "--global-config", _global_config(base, **keys),
        "--embedding-config", str(EXAMPLE / "embedding_config.yml"), *role[1:]), env=env)
    try:
        assert job.wait(timeout=60) == CONFIG_EXIT_CODE, job.output()
        out = job.output()
        assert re.search(rf"persia-launcher {role[0]}: config error: " + line, out), out
        assert "the script started" not in out and "ready" not in out, out
        assert "Traceback" not in out and "holding" not in out, out
        assert os.listdir(locked) == []
    finally:
        job.stop()


_FOLLOWS_A_STREAM = """
from persia_py.ctx import DataCtx
from persia_py.input.readers import CsvColumn, CsvReaderConfig
from persia_py.input.stream_reader import CsvFormat, StreamReader
from persia_py.stream_source import follow

print("the script started", flush=True)
config = CsvReaderConfig(columns=(CsvColumn(name="x", kind="float"),), header=True)
reader = StreamReader({stream!r}, CsvFormat(config), pattern="*.csv")
# As a loader's script starts (without the embedding workers `with DataCtx()` waits for).
for part in follow(DataCtx().recover(), reader, batch_size=1, position_log={log!r}):
    raise AssertionError("a batch was made")
"""


def test_a_position_log_its_loader_cannot_write_stops_the_loader_for_good(
        unwritable: Unwritable) -> None:
    """`follow(position_log=...)` in a folder the loader cannot write: a ConfigError before
    the loader's first batch, which ends its role with 78 (a restart would meet it)."""
    base, locked = unwritable.base, unwritable.locked
    (base / "stream").mkdir()
    (base / "stream" / "part-0.csv").write_text("x\n1.0\n")
    log = locked / "loader-0.positions"
    script = base / "loader.py"
    script.write_text(_FOLLOWS_A_STREAM.format(stream=str(base / "stream"), log=str(log)))
    job = RoleProcess(unwritable.command(
        "data-loader", "--port", "0", "--global-config", _global_config(base),
        "--embedding-config", str(EXAMPLE / "embedding_config.yml"), str(script)),
        env={**os.environ, "PERSIA_EMBEDDING_WORKER_ADDRS": "127.0.0.1:1"})
    try:
        assert job.wait(timeout=60) == CONFIG_EXIT_CODE, job.output()
        out = job.output()
        assert out.count("the script started") == 1, out
        assert re.search(r"ConfigError: " + _cannot_write(
            "follow(position_log=...)", log, unwritable, _LOG_IN.format(locked)), out), out
        assert "a batch was made" not in out and os.listdir(locked) == []
    finally:
        job.stop()


def test_a_role_told_to_hold_holds_on_a_folder_it_cannot_write(unwritable: Unwritable) -> None:
    """A parameter server of a StatefulSet whose volume it cannot write: restarted, it
    would meet the same folder; it says why and holds instead."""
    locked = unwritable.locked
    job = RoleProcess(unwritable.command(
        "embedding-parameter-server", "--hold-on-config-error", "--port", "0",
        "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
        "--update-log", str(locked / "updates")))
    try:
        _held_until_sigterm(job, "embedding-parameter-server")
        out = job.output()
        assert re.search(_cannot_write("--update-log", locked / "updates", unwritable,
                                       _MADE_IN.format(locked)), out), out
        assert "ready" not in out and os.listdir(locked) == [], out
    finally:
        job.stop()

"""A folder the job's user cannot write is refused at start, never met at the first write.

A checkpoint or export folder, the run folder, a log's folder, a loader's position log:
``persia-launcher local`` refuses it before it starts anything, and each role refuses what
it writes, naming the folder, its key or flag and the user, with the config exit code 78
(a restart would meet the same folder): not a PermissionError at the first write,
restarted into again.
"""

from __future__ import annotations

import dataclasses
import os
import pwd
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from checkout import EXAMPLE
from child_processes import RoleProcess, held_until_sigterm, launcher_command, processes_with_marker

from persia_py.ops.start_checks import CONFIG_EXIT_CODE

pytestmark = pytest.mark.processes


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
        held_until_sigterm(job, "embedding-parameter-server")
        out = job.output()
        assert re.search(_cannot_write("--update-log", locked / "updates", unwritable,
                                       _MADE_IN.format(locked)), out), out
        assert "ready" not in out and os.listdir(locked) == [], out
    finally:
        job.stop()

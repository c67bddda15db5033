"""A local job's run folder and logs are its owner's alone (``persia_py/ops/private_files.py``):
the folder is made 0700 whatever the umask and refused when others own it or may write
into it; every log is written 0600; a ``.rewind`` beside a handover log is honoured only
by a restart, and only when the job's own loader wrote it for the stream it replays."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from checkout import EXAMPLE
from child_processes import launcher_command

from persia_py.checkpoint import rewind
from persia_py.config import GlobalConfig
from persia_py.env import PersiaEnv
from persia_py.ids.positions import DataPositions, Position
from persia_py.ops.final_errors import ENV_RANK_FAILED_FILE
from persia_py.ops.private_files import UnsafeFolderError, private_folder


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask() -> Iterator:
    """Set the process's umask for the test; restored after."""
    saved = os.umask(0o022)
    try:
        yield os.umask
    finally:
        os.umask(saved)


@pytest.mark.parametrize("mask", [0o000, 0o022, 0o277])
def test_a_run_folder_is_made_0700_whatever_the_umask(tmp_path, umask, mask: int) -> None:
    umask(mask)
    folder = private_folder(tmp_path / "runs" / "run-1")
    assert _mode(folder) == 0o700
    assert private_folder(folder) == folder  # an existing one of this user's: taken


def test_a_run_folder_others_may_write_into_or_own_is_refused(tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    for mode in (0o777, 0o770, 0o1777, 0o702):
        shared.chmod(mode)
        with pytest.raises(UnsafeFolderError) as refused:
            private_folder(shared)
        assert str(refused.value) == (
            f"run folder {shared}: group or others may write into it (mode {mode & 0o7777:04o}); "
            f"a run folder must be writable by its owner only: chmod go-w {shared}, or choose "
            "another folder")
    shared.chmod(0o755)  # readable by others, writable by its owner only: taken as it is
    private_folder(shared)
    assert _mode(shared) == 0o755
    if os.geteuid() != 0:
        pytest.skip("making a folder of another user's needs root")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(UnsafeFolderError, match=(
            f"run folder {theirs}: owned by uid 65534, not by this user \\(uid 0\\); a run "
            "folder must be this user's own: choose another folder")):
        private_folder(theirs)


@pytest.mark.processes
def test_local_refuses_a_run_folder_others_may_write_into(tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o777)
    done = subprocess.run(launcher_command(
        "local", "--nn-worker", "missing_train.py", "--data-loader", "missing_loader.py",
        "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
        "--run-dir", str(run_dir), "--no-metrics"), capture_output=True, text=True,
        timeout=120)
    assert done.returncode != 0
    assert (f"--run-dir: run folder {run_dir}: group or others may write into it (mode 0777)"
            in done.stderr), done.stdout + done.stderr
    assert list(run_dir.iterdir()) == []  # nothing started, nothing written


def test_every_log_is_written_0600_whatever_the_umask(tmp_path, umask, monkeypatch) -> None:
    from persia_py.input.stream_reader import StreamPosition
    from persia_py.launcher.recovery import TrainingRecovery
    from persia_py.ops.final_errors import report_failure
    from persia_py.servers.update_log import UpdateLog
    from persia_py.stream_source import PositionLog
    from persia_py.telemetry.progress import StepReporter
    from persia_py.workers.handover_log import Handover, HandoverLog

    umask(0)
    handovers = HandoverLog(tmp_path / "handovers.log", replay=False, compact_every=2)
    handovers.stream("loader0-abc")
    handovers.handed(Handover(0, 0, b"c" * 16, 1))  # the second line: compacted
    handovers.close()
    updates = UpdateLog(tmp_path / "ps-0-updates", 0)
    updates.begin("start", None)
    updates.close()
    positions = PositionLog(tmp_path / "positions.log")
    positions.append(0, StreamPosition("a.csv"), StreamPosition("a.csv", 10, 1))
    positions.close()
    with open(tmp_path / "positions.log", "a") as f:
        f.write('{"seq": 1')  # a torn line: the next start rewrites the log without it
    PositionLog(tmp_path / "positions.log").close()
    reporter = StepReporter(rank=0, train_log=str(tmp_path / "train_log.jsonl"))
    reporter.close()
    recovery = TrainingRecovery(None, servers=[], training=[], root=None, max_restarts=1,
                                train_log=str(tmp_path / "restarts.jsonl"), log=print)
    recovery._record("nn-worker", "code 1", None)
    monkeypatch.setenv(ENV_RANK_FAILED_FILE, str(tmp_path / "rank-failed"))
    report_failure(0, RuntimeError("peer gone"))
    rewind.write_rewind(tmp_path / "handovers.log", DataPositions(), "loader0-abc")

    logs = ["handovers.log", "positions.log", "train_log.jsonl", "restarts.jsonl",
            "rank-failed", "handovers.log.rewind",
            *(f"ps-0-updates/{p.name}" for p in (tmp_path / "ps-0-updates").iterdir())]
    assert len(logs) > 6
    assert {name: _mode(tmp_path / name) for name in logs} == dict.fromkeys(logs, 0o600)
    assert _mode(tmp_path / "ps-0-updates") == 0o700
    # A log an earlier run left readable by others is made private when opened again.
    (tmp_path / "train_log.jsonl").chmod(0o644)
    StepReporter(rank=0, train_log=str(tmp_path / "train_log.jsonl")).close()
    assert _mode(tmp_path / "train_log.jsonl") == 0o600


def _loader(log: Path, *, replay: bool):
    from persia_py.workers.data_loader import DataCtx

    env = PersiaEnv(embedding_worker_addrs=("127.0.0.1:1",), data_loader_handover_log=str(log),
                    data_loader_replay=replay)
    return DataCtx(env=env, global_config=GlobalConfig()).recover()  # serves nothing until `with`


def test_a_planted_rewind_is_not_honoured_only_the_jobs_own(tmp_path) -> None:
    from persia_py.proto import common_pb2
    from persia_py.workers.loader_service import DataLoaderServicer

    log = tmp_path / "data-loader-0-handovers.log"
    planted = rewind.rewind_file(log)
    trained = DataPositions({0: Position(50)})
    # Left by another run (the old format too), or planted: a first start removes it.
    for text in (trained.to_text(), json.dumps({"stream": "loader0-0123456789abcdef",
                                               "positions": trained.to_text()})):
        planted.write_text(text)
        first = _loader(log, replay=False)
        first.log.close()
        assert first._done.next == 0 and not planted.exists()
    # A restart replays the log: positions naming another stream are not its.
    planted.write_text(json.dumps({"stream": "loader0-planted", "positions": trained.to_text()}))
    again = _loader(log, replay=True)
    again.log.close()
    assert again._done.next == 0 and not planted.exists()
    assert again.stream == first.stream  # the log replayed as usual

    # The job's own Rewind, answered by this loader during this run: the restart takes it.
    running = _loader(log, replay=True)
    # As if it had made 50 batches: a Rewind names only batches made (rewind.check_made).
    servicer = DataLoaderServicer(running.batches, loader_index=0, num_made=lambda: 50)
    request = common_pb2.RestartRequest(reason="test", positions=trained.to_text())
    servicer.Rewind(request, _Context())
    running.log.close()
    rewound = _loader(log, replay=True)
    rewound.log.close()
    assert rewound._done.next == 50 and rewound.stream != running.stream
    assert not planted.exists()


class _Context:
    def abort(self, code, details):
        raise RuntimeError(f"{code.name}: {details}")

    def add_callback(self, callback) -> None:
        pass  # would exit the process

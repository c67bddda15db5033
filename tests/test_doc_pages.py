"""docs/online_training.md and docs/serving.md run as written: every fenced block of the
two pages is a file of the job, a command run, or code run, taken from the page as it is;
so does docs/your_data.md's reading loop.

Nothing is added but what the pages leave to the reader: the stream's files, the folder
the online page calls ``/data/job`` (a test's own), a free port for the metrics port the
serving page names (9400) and the serve port its example prints (41237), and
``PERSIA_LOG_EVERY=1`` (docs/running.md: a progress line per step, to wait on before
stopping the job). ``test_the_pages_have_the_blocks_run_here`` fails when a block is added
or changed in a way these tests do not run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from checkout import ROOT
from child_processes import RoleProcess, launcher_command, stop_all
from grpc_calls import env_without_token

from persia_py.checkpoint import layout as fmt
from persia_py.config import CommonConfig
from persia_py.input.readers import CsvColumn, CsvReaderConfig
from persia_py.input.stream_reader import CsvFormat, StreamReader
from persia_py.launcher.ports import free_ports
from persia_py.serving import ServingClient
from persia_py.wire.security import ENV_AUTH_TOKEN

processes = pytest.mark.processes


def _blocks(page: str) -> list[tuple[str, str]]:
    """``(language, text)`` of each fenced block of ``docs/<page>``, in order."""
    text = (ROOT / "docs" / page).read_text()
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S)


ONLINE = _blocks("online_training.md")
SERVING = _blocks("serving.md")
YOUR_DATA = _blocks("your_data.md")
LOADER, FROM_CSR, MODEL, EMBEDDING_CONFIG, TRAIN, GLOBAL_CONFIG, RUN = (t for _, t in ONLINE)
SERVE, CLIENT, FRESH_CONFIG, SERVE_FRESH = (t for _, t in SERVING)
_HASH, READ_CSV, _CRITEO = (t for _, t in YOUR_DATA)


def test_the_pages_have_the_blocks_run_here() -> None:
    assert [(lang, text.splitlines()[0]) for lang, text in ONLINE] == [
        ("python", "# loader.py"), ("python", "from persia_py.embedding.data import "
                                              "IDTypeFeature, Label, PersiaBatch"),
        ("python", "# model.py"), ("yaml", "# embedding_config.yml"), ("python", "# train.py"),
        ("yaml", "# global_config.yml"), ("bash", "persia-launcher local --nn-worker train.py "
                                                  "--data-loader loader.py \\")]
    assert [(lang, text.splitlines()[0]) for lang, text in SERVING] == [
        ("bash", "export PERSIA_AUTH_TOKEN=$(cat RUN_DIR/auth_token)  # the training job's "
                 "token (below)"), ("python", "import numpy as np"),
        ("yaml", "# global_config.yml of the training job (and of serve, for the warning "
                 "thresholds)"), ("bash", "persia-launcher serve --checkpoint ckpt/ "
                                          "--follow-increments ckpt/inc \\")]
    assert [(lang, text.splitlines()[0]) for lang, text in YOUR_DATA] == [
        ("python", "import numpy as np"),
        ("python", "from persia_py.data_readers import CsvColumn, CsvReader, CsvReaderConfig"),
        ("bash", "python examples/criteo_tsv/generate_tsv.py train.tsv --rows 20000 --seed 1")]


def _commands(block: str) -> list[list[str]]:
    """The commands of a bash block (continued lines joined, comments and ``&`` dropped)."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = [line.split("#")[0].strip().rstrip("&").strip() for line in joined.splitlines()]
    return [shlex.split(line) for line in lines if line]


def _launcher(command: list[str]) -> list[str]:
    assert command[0] == "persia-launcher", command
    return launcher_command(*command[1:])


def _stream_file(folder: Path, index: int, rows: int = 200) -> None:
    """A stream file of the online page's columns (label, x, user, item), written as a
    producer would: a hidden name renamed into place."""
    rng = np.random.default_rng(index)
    user, item = rng.integers(0, 40, rows), rng.integers(0, 60, rows)
    label = (rng.random(rows) < 0.2 + 0.5 * (user % 2)).astype(int)
    x = rng.normal(size=rows).round(3)
    part = folder / f".{index:03d}.part"
    part.write_text("label,x,user,item\n" + "".join(
        f"{a},{b},{c},{d}\n" for a, b, c, d in zip(label, x, user, item)))
    os.rename(part, folder / f"{index:03d}.csv")


def _job_files(work: Path, global_config: str) -> None:
    for name, text in [("loader.py", LOADER), ("model.py", MODEL), ("train.py", TRAIN),
                       ("embedding_config.yml", EMBEDDING_CONFIG),
                       ("global_config.yml", global_config)]:
        (work / name).write_text(text)
    stream = work / "incoming" / "loader-0"
    stream.mkdir(parents=True)
    _stream_file(stream, 0)


def _train_then_stop(work: Path) -> tuple[str, Path]:
    """The online page's command, run in ``work`` until it trained a step, then stopped
    as the page stops it (SIGTERM); its output and the final checkpoint it exited 0
    after (the newest in the page's ``dir``)."""
    (start, *_rest) = _commands(RUN)
    job = RoleProcess(_launcher(start), env={**env_without_token(), "PERSIA_LOG_EVERY": "1"},
                      cwd=work)
    try:
        job.wait_for_line(r"\[nn-worker\] .*step \d+ \| \d+ samples", timeout=240)
        os.kill(job.process.pid, signal.SIGTERM)  # kill -TERM %1
        assert job.wait(timeout=240) == 0, job.output()
    finally:
        job.stop()
    out = "".join(job.lines)
    final = fmt.latest(work / "ckpt")
    assert final is not None, out[-5000:]
    return out, final


def _run_folder(out: str) -> Path:
    return Path(re.search(r"\[launcher\] run folder (\S+);", out).group(1))


@processes
def test_the_online_training_page_runs_as_written(tmp_path: Path) -> None:
    work = tmp_path / "job"  # the page's /data/job
    work.mkdir()
    _job_files(work, GLOBAL_CONFIG.replace("/data/job", str(work)))
    _, first = _train_then_stop(work)
    # "start it again with the same command: it resumes where it stopped"
    _stream_file(work / "incoming" / "loader-0", 1)
    again, final = _train_then_stop(work)
    assert final != first  # it trained the new file, and checkpointed it at its stop
    log = [json.loads(line) for line in
           (_run_folder(again) / "train_log.jsonl").read_text().splitlines()]
    (resume,) = [r for r in log if r.get("event") == "resume"]
    assert resume["step"] >= 1 and Path(resume["checkpoint"]).name == first.name, resume
    steps = [r["step"] for r in log if "loss" in r]
    assert steps and steps[0] == resume["step"] + 1, log[:3]
    # Progressive validation's last, shorter window, with the GAUC by user.
    assert any("pv_gauc" in r for r in log), log[-3:]


def test_the_from_csr_example_runs_on_a_read_part(tmp_path: Path) -> None:
    (tmp_path / "000.csv").write_text("label,tags\n1,3 17 42\n0,\n1,5\n")
    config = CsvReaderConfig(columns=(CsvColumn(name="label", kind="float"),
                                      CsvColumn(name="tags", kind="ids")), header=True)
    reader = StreamReader(tmp_path, CsvFormat(config), pattern="*.csv", idle_timeout_sec=0.1,
                          poll_interval_sec=0.01, max_wait_sec=0.01)
    (part,) = list(reader.batches(10))
    names = {"r": part.records, "part": part}
    exec(FROM_CSR, names)  # noqa: S102 - the page's code, as written
    batch = names["batch"]
    assert batch.batch_size == 3 and names["lengths"].tolist() == [3, 0, 1]


def test_the_csv_reader_example_reads_a_loaders_share(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/your_data.md's reading loop, run as written in data loader 0 of 2: its batch
    holds that loader's share of the file (the first half, to within a line), and
    ``every_record`` all of it."""
    lines = [f"{i % 2},u{i % 3},{' '.join(map(str, range(i % 4)))}\n" for i in range(40)]
    (tmp_path / "clicks.csv").write_text("click,user,tags\n" + "".join(lines))
    monkeypatch.chdir(tmp_path)  # the page's clicks.csv
    monkeypatch.setenv("PERSIA_DATA_LOADER_REPLICA_INDEX", "0")
    monkeypatch.setenv("PERSIA_DATA_LOADER_REPLICA_SIZE", "2")
    names: dict = {}
    exec(READ_CSV, names)  # noqa: S102 - the page's code, as written
    assert names["every_record"].num_records == 40
    share = names["records"]
    assert 15 <= share.num_records <= 25 and share.rows[0] == 2, share.rows
    assert names["batch"].batch_size == share.num_records
    np.testing.assert_array_equal(names["lengths"], [i % 4 for i in range(share.num_records)])


@processes
def test_the_serving_page_runs_as_written_with_the_jobs_token(tmp_path: Path) -> None:
    """The online job trained with the serving page's config (its own token, made by
    `local`), then both `serve` commands, each queried by the page's client code with the
    job's token (`export PERSIA_AUTH_TOKEN=$(cat RUN_DIR/auth_token)`)."""
    _job_files(tmp_path, FRESH_CONFIG)
    out, _ = _train_then_stop(tmp_path)
    token = (_run_folder(out) / "auth_token").read_text().strip()
    (export, serve), (serve_fresh,) = _commands(SERVE), _commands(SERVE_FRESH)
    assert export == ["export", "PERSIA_AUTH_TOKEN=$(cat", "RUN_DIR/auth_token)"]
    metrics_port = str(free_ports(1, "127.0.0.1")[0])
    serve_fresh = [metrics_port if a == "9400" else a for a in serve_fresh]
    # Both serve commands at once (each loads the checkpoint itself); then each is queried.
    servers = []
    try:
        for command in (serve, serve_fresh):
            servers.append(RoleProcess(_launcher(command), env={
                **env_without_token(), ENV_AUTH_TOKEN: token}, cwd=tmp_path))
        for command, server in zip((serve, serve_fresh), servers):
            port = server.wait_for_line(r"serve ready on port (\d+)", timeout=240).group(1)
            probabilities = _client_code(tmp_path, port, token)
            assert probabilities.shape == (2, 1) and ((0 < probabilities) & (
                probabilities < 1)).all(), probabilities
            if command is serve_fresh:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                            timeout=30) as answer:
                    assert b"persia_serving_dense_model_age_seconds" in answer.read()
            # Without the token: refused.
            anonymous = ServingClient(f"127.0.0.1:{port}", CommonConfig(rpc_timeout_sec=30))
            with pytest.raises(grpc.RpcError) as info:
                anonymous.predict([("user", np.array([1], np.uint64), np.ones(1, np.int32)),
                                   ("item", np.array([1], np.uint64), np.ones(1, np.int32))],
                                  [np.zeros((1, 1), np.float32)])
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            anonymous.close()
    finally:
        stop_all(servers)


def _client_code(work: Path, port: str, token: str) -> np.ndarray:
    """The page's Python client, run in ``work`` with the job's token exported, against
    the port `serve` printed; its ``probabilities``."""
    saved_token, saved_cwd = os.environ.get(ENV_AUTH_TOKEN), os.getcwd()
    os.environ[ENV_AUTH_TOKEN] = token
    os.chdir(work)
    try:
        names: dict = {}
        exec(CLIENT.replace("41237", port), names)  # noqa: S102 - the page's code
        names["client"].close()
        return names["probabilities"]
    finally:
        os.chdir(saved_cwd)
        if saved_token is None:
            del os.environ[ENV_AUTH_TOKEN]
        else:
            os.environ[ENV_AUTH_TOKEN] = saved_token

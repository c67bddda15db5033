"""The online test job (tests/online_job) and its stream, for the online tests: stream
files written as a producer would, the job started by ``persia-launcher local``, the sample
ids its ranks trained, its checkpoints and its training log."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import numpy as np
from checkout import ROOT
from child_processes import RoleProcess, launcher_command

from persia_py.checkpoint import layout as fmt
from persia_py.ops import safe_files

JOB = ROOT / "tests" / "online_job"
ROWS_PER_FILE = 96


def csv_rows(first: int, count: int) -> str:
    rng = np.random.default_rng(first)
    sid = np.arange(first, first + count)
    user, item = rng.integers(0, 50, count), rng.integers(0, 80, count)
    label = (rng.random(count) < 0.3 + 0.4 * (user % 2)).astype(int)
    x = rng.normal(size=count).round(4)
    return "".join(f"{s},{y},{v},{u},{i}\n" for s, y, v, u, i in zip(sid, label, x, user, item))


def add_file(folder: Path, index: int) -> int:
    """Write stream file ``index`` whole (as a producer would: a hidden name, renamed into
    place); returns its number of rows."""
    tmp = folder / f".{index:03d}.part"
    tmp.write_text("sid,label,x,user,item\n" + csv_rows(index * ROWS_PER_FILE, ROWS_PER_FILE))
    os.rename(tmp, folder / f"{index:03d}.csv")
    return ROWS_PER_FILE


TEST_FIRST_ID = 1_000_000
"""The first sample id of the rows a job is tested on (:func:`write_test_rows`): no stream
reaches it."""


def write_test_rows(path: Path, count: int = 4000) -> Path:
    """Rows as the stream's, never trained (``train.py --test-csv``); returns ``path``."""
    path.write_text("sid,label,x,user,item\n" + csv_rows(TEST_FIRST_ID, count))
    return path


def write_config(work: Path, every_steps: int) -> None:
    (work / "global_config.yml").write_text(
        (ROOT / "examples" / "criteo_synthetic" / "global_config.yml").read_text()
        + textwrap.dedent(f"""
            checkpoint_config:
              root: {work}
              dir: {work / "ckpt"}
              every_steps: {every_steps}
              incremental_dir: {work / "increments"}
              incremental_every_sec: 3600
        """))


def start(work: Path, run: str, num_ranks: int, loader_args: str = "", nn_args: str = ""
          ) -> RoleProcess:
    return RoleProcess(launcher_command(
        "local", "--nn-worker", str(JOB / "train.py"), "--data-loader", str(JOB / "data_loader.py"),
        "--embedding-config", str(JOB / "embedding_config.yml"),
        "--global-config", str(work / "global_config.yml"), "--nproc-per-node", str(num_ranks),
        "--run-dir", str(work / run), "--no-metrics",
        "--data-loader-args",
        f"--stream {work / 'stream'} --positions {work / 'positions'} {loader_args}",
        "--nn-worker-args", f"--out {work / run} {nn_args}"))


def trained_ids(run_dir: Path) -> np.ndarray:
    text = " ".join(p.read_text() for p in sorted(run_dir.glob("ids-rank*.txt")))
    return np.array(text.split(), dtype=np.int64)


def checkpoint_steps(work: Path) -> list[tuple[int, int]]:
    """(batches of all ranks, the job's step) of each checkpoint kept, oldest first."""
    manifests = [safe_files.load_json(p / fmt.MANIFEST) for p in (work / "ckpt").glob("ckpt-*")]
    return sorted((m["step"], m["job_step"]) for m in manifests)


def check_log_goes_on(records: list[dict], resumed_at: list[int], every: int,
                       last: int) -> None:
    """Over the runs of one log (rank 0's): step records from 1 on, rising; a ``resume``
    event at each step in ``resumed_at``, the next step record the one after it; and
    progressive-validation reports at the multiples of ``every`` and at each run's end
    (the last run's at step ``last``)."""
    steps = [r["step"] for r in records if "loss" in r]
    assert steps[0] == 1 and all(a < b for a, b in zip(steps, steps[1:])), steps
    resumes = [i for i, r in enumerate(records) if r.get("event") == "resume"]
    assert [records[i]["step"] for i in resumes] == resumed_at, records
    for i, end in zip(resumes, [*resumes[1:], len(records)]):
        # (With two ranks rank 0 may have had no batch in a run: then no step record.)
        first = next((r["step"] for r in records[i:end] if "loss" in r), None)
        assert first in (None, records[i]["step"] + 1), records[i:end]
    ends = {*resumed_at, last}
    assert all(r["step"] % every == 0 or r["step"] in ends
               for r in records if "pv_auc" in r), records


def run_to_its_end(work: Path, run: str, loader_args: str, num_ranks: int = 1
                    ) -> tuple[str, np.ndarray]:
    """Run the job (the same command each time) until it ends by itself; its output and
    the sample ids it trained (moved aside, so the next run's are its own)."""
    job = start(work, "run", num_ranks, loader_args)
    out = job.finish(timeout=180)
    ids = trained_ids(work / "run")
    for path in (work / "run").glob("ids-rank*.txt"):
        path.rename(path.with_name(f"{run}-{path.name}"))
    return out, ids

"""Bring your own data, end to end: a TSV file in Criteo's layout (label, 13 integer
columns, 26 hex categorical columns) trained through the CSV reader by ``persia-launcher
local`` with two data loaders. Every row is trained exactly once (by row id: its line
number) though the example has no sharding code, and the model learns."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
from checkout import ROOT
from child_processes import RoleProcess, launcher_command, processes_with_marker

pytestmark = pytest.mark.processes

EXAMPLE = ROOT / "examples" / "criteo_tsv"
NUM_TRAIN = 20_000


def _generate(path, rows: int, seed: int) -> None:
    subprocess.run([sys.executable, str(EXAMPLE / "generate_tsv.py"), str(path),
                    "--rows", str(rows), "--seed", str(seed)], check=True, timeout=120)


def test_two_loaders_train_every_row_once_and_the_model_learns(tmp_path) -> None:
    train, test, rows_dir = tmp_path / "train.tsv", tmp_path / "test.tsv", tmp_path / "rows"
    _generate(train, NUM_TRAIN, seed=1)
    _generate(test, 5_000, seed=2)
    # The example's own code never asks which loader it is: the reader does.
    for name in ("data_loader.py", "criteo_layout.py"):
        source = (EXAMPLE / name).read_text()
        assert not re.search(r"replica_index|REPLICA|PersiaEnv|ReaderShare\(", source), name
    job = RoleProcess(launcher_command(
        "local", "--nn-worker", str(EXAMPLE / "train.py"),
        "--data-loader", str(EXAMPLE / "data_loader.py"),
        "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
        "--global-config", str(EXAMPLE / "global_config.yml"),
        "--num-data-loaders", "2", "--run-dir", str(tmp_path / "run"), "--no-metrics",
        "--data-loader-args", f"--train {train}",
        "--nn-worker-args", f"--test {test} --trained-rows {rows_dir}",
    ))
    try:
        code = job.wait(timeout=300)
        output = job.output()
        assert code == 0, output
        trained = np.load(rows_dir / "rank-0.npy")
        # Row r is line r + 1 of the file: each line exactly once, none missing.
        assert trained.size == NUM_TRAIN, output
        np.testing.assert_array_equal(np.sort(trained), np.arange(1, NUM_TRAIN + 1))
        # Both loaders read a share, and the shares are about equal.
        sent = {int(m.group(1)): int(m.group(2)) for m in
                re.finditer(r"data loader (\d) sent (\d+) batches", output)}
        assert set(sent) == {0, 1} and abs(sent[0] - sent[1]) <= 2, output
        auc = float(re.search(r"test_auc: ([0-9.]+)", output).group(1))
        assert auc > 0.68, output
        assert processes_with_marker(job.marker) == []
    finally:
        job.stop()

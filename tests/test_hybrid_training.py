"""Hybrid training through ``persia-launcher local``: accuracy on UCI Adult against sync
SGD, and reproducible runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from checkout import EXAMPLE, ROOT
from child_processes import RoleProcess, launcher_command, processes_with_marker

pytestmark = pytest.mark.processes

ADULT_CSV = ROOT.parent / "shared" / "data" / "adult.csv"
RUN_ADULT = ROOT / "examples" / "adult_income" / "run_local.py"


def _test_auc(job: RoleProcess, timeout: float) -> float:
    try:
        code = job.wait(timeout=timeout)
        assert code == 0, job.output()
        assert processes_with_marker(job.marker) == [], job.output()
        (line,) = [line for line in job.lines if "test_auc:" in line]
        return float(line.split("test_auc:")[1])
    finally:
        job.stop()


needs_adult = pytest.mark.skipif(not ADULT_CSV.exists(), reason=f"{ADULT_CSV} is absent")


def _adult_configs(folder: Path) -> tuple[Path, dict[str, Path]]:
    """The example's global config with float16 on the wire, and its embedding config
    with float32 and with float16 rows."""
    example = RUN_ADULT.parent
    global_config = folder / "global_config.yml"
    global_config.write_text((example / "global_config.yml").read_text()
                             + "common_config:\n  embedding_fp16: true\n")
    embedding = {}
    for row_dtype in ("float32", "float16"):
        embedding[row_dtype] = folder / f"{row_dtype}.yml"
        embedding[row_dtype].write_text((example / "embedding_config.yml").read_text()
                                        + f"row_dtype: {row_dtype}\n")
    return global_config, embedding


def _adult_job(global_config: Path, embedding_config: Path, *args: str) -> RoleProcess:
    return RoleProcess([
        sys.executable, str(RUN_ADULT), "--csv", str(ADULT_CSV),
        "--embedding-config", str(embedding_config), "--global-config", str(global_config),
        *args])


@pytest.fixture(scope="module")
def adult_sync(tmp_path_factory) -> tuple[dict[str, float], tuple[Path, dict[str, Path]]]:
    """One epoch of sync SGD on Adult (1 rank, staleness 1, the reproducible mode), float16
    on the wire, with float32 rows (the baseline of both tests below) and with float16 rows:
    their test AUCs by row type. The two jobs run side by side: each trains the same seeds
    in the same batch order whatever the other does."""
    configs = _adult_configs(tmp_path_factory.mktemp("adult"))
    jobs = {rows: _adult_job(configs[0], path, "--reproducible")
            for rows, path in configs[1].items()}
    try:
        return {rows: _test_auc(job, 300) for rows, job in jobs.items()}, configs
    finally:
        for job in jobs.values():
            job.stop()


@needs_adult
def test_adult_hybrid_is_as_accurate_as_sync_sgd(adult_sync) -> None:
    """One epoch: sync (1 rank, staleness 1) and hybrid (2 ranks, staleness 8) both reach
    AUC 0.900, and hybrid is no more than 0.002 below sync."""
    aucs, (global_config, embedding) = adult_sync
    sync = aucs["float32"]
    hybrid = _test_auc(_adult_job(global_config, embedding["float32"], "--nproc-per-node", "2",
                                  "--embedding-staleness", "8"), 300)
    assert sync >= 0.900, sync
    assert hybrid >= 0.900, hybrid
    assert hybrid >= sync - 0.002, (sync, hybrid)


@needs_adult
def test_adult_float16_rows_are_as_accurate_as_float32_rows(adult_sync) -> None:
    """Sync SGD, the same seeds and batch order, float16 on the wire: the rows stored in
    float16 (updated with stochastic rounding, sent as stored) end within 0.001 test AUC
    of float32 rows."""
    aucs, _ = adult_sync
    float32, float16 = aucs["float32"], aucs["float16"]
    assert float32 >= 0.900, float32
    assert abs(float16 - float32) <= 0.001, (float32, float16)


def test_reproducible_runs_give_identical_losses(tmp_path) -> None:
    """Two runs of one job, side by side (each slows the other at its own moments: the
    losses must depend on no timing), log the same loss at every step."""
    paths = [tmp_path / f"losses{run}.txt" for run in range(2)]
    jobs = [RoleProcess(launcher_command(
        "local", "--nn-worker", str(EXAMPLE / "train.py"),
        "--data-loader", str(EXAMPLE / "data_loader.py"),
        "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
        "--global-config", str(EXAMPLE / "global_config.yml"), "--num-ps", "2",
        "--run-dir", str(tmp_path / f"run{run}"),
        "--data-loader-args", "--train-samples 8000",
        "--nn-worker-args", f"--reproducible --embedding-staleness 1 --test-samples 2000 "
                            f"--loss-log {log}",
    )) for run, log in enumerate(paths)]
    try:
        for job in jobs:
            _test_auc(job, 300)
    finally:
        for job in jobs:
            job.stop()
    logs = [log.read_text().split() for log in paths]
    assert len(logs[0]) == 8000 // 256 + 1
    assert logs[0] == logs[1]

"""Every benchmark runs: ``python -m benchmarks.<name> --smoke --json PATH`` for each module
``benchmarks/`` holds with a ``__main__`` block, in a subprocess with a timeout, must exit 0
and write its JSON. A new benchmark without ``--smoke`` fails here (its parser exits 2), and
a module or folder that is not a benchmark must be named in ``HELPERS`` with what runs it.

Smoke runs use real processes where their benchmarks do, at tiny sizes (``--smoke``, see
``benchmarks/__init__.py``); no figure of theirs is asserted but facts that do not depend on
the machine. They run two at a time in their own folders (a benchmark's result does not
depend on its timing), started together by the module's first smoke test; with
``pytest-xdist`` they stay on one worker (``--dist loadgroup``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from checkout import ROOT

BENCHMARKS = ROOT / "benchmarks"
HELPERS = {
    "density_accuracy": "benchmarks.density --parts accuracy (five full training jobs; "
                        "not in the smoke)",
    "disk_tier_adult": "benchmarks.disk_tier (auc_delta_adult)",
    "disk_tier_checkpoint": "benchmarks.disk_tier (checkpoint_gb_per_s)",
    "ps_process": "the benchmarks that start a parameter server or embedding worker",
    "role_cpu": "train_throughput, compare and scaling (tests/test_compare_benchmark.py "
                "too)",
    "role_processes": "recovery, and the chaos tests",
    "throughput": "the job scripts of train_throughput, compare, scaling, "
                  "plain_beside_load and shm_round_trip (each passes --smoke on)",
}
"""Modules and folders of ``benchmarks/`` that are not benchmarks, and what runs them."""
NUM_PARALLEL = 2
TIMEOUT_S = 300.0
"""Per smoke run: minutes more than any takes on a loaded 2-core machine."""
SLOWEST_FIRST = ("recovery", "compare", "dense_sharding", "plain_beside_load",
                 "online_freshness", "train_throughput", "scaling", "shm_round_trip")
"""Started first, so that the short ones fill the gaps at the end."""


def _is_benchmark(path: Path) -> bool:
    """Runnable as ``python -m benchmarks.<name>``."""
    if path.is_dir():
        return (path / "__main__.py").exists()
    return 'if __name__ == "__main__":' in path.read_text()


def _entries() -> list[Path]:
    return sorted(p for p in BENCHMARKS.iterdir()
                  if (p.suffix == ".py" and p.stem != "__init__")
                  or (p.is_dir() and not p.name.startswith(("_", "."))))


BENCHMARK_NAMES = [p.stem for p in _entries() if _is_benchmark(p)]


def test_every_module_of_benchmarks_is_a_benchmark_or_a_named_helper() -> None:
    others = {p.stem for p in _entries() if not _is_benchmark(p)}
    assert others == set(HELPERS), (
        f"not runnable as python -m benchmarks.NAME and not in HELPERS: "
        f"{sorted(others - set(HELPERS))}; in HELPERS but gone or runnable: "
        f"{sorted(set(HELPERS) - others)}")
    assert len(BENCHMARK_NAMES) >= 15, BENCHMARK_NAMES  # the listing found them


@dataclass
class SmokeRun:
    returncode: int
    output: str
    json_path: Path
    seconds: float


def _run(name: str, folder: Path) -> SmokeRun:
    """One smoke run in ``folder`` (its working directory: relative paths land there);
    on timeout its whole process group is killed."""
    out = folder / f"{name}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", f"benchmarks.{name}", "--smoke",
                             "--json", str(out)], cwd=folder, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=60)
        output += f"\n[test] killed after {TIMEOUT_S:.0f} s"
    return SmokeRun(proc.returncode, output, out, time.monotonic() - started)


@pytest.fixture(scope="module")
def smoke_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Every selected benchmark's smoke run, started at once, ``NUM_PARALLEL`` at a time."""
    selected = {item.callspec.params["name"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    order = sorted(selected, key=lambda n: (SLOWEST_FIRST.index(n)
                                            if n in SLOWEST_FIRST else len(SLOWEST_FIRST), n))
    pool = ThreadPoolExecutor(max_workers=NUM_PARALLEL, thread_name_prefix="smoke")
    runs: dict[str, Future[SmokeRun]] = {
        name: pool.submit(_run, name, tmp_path_factory.mktemp(f"smoke-{name}"))
        for name in order}
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


def _check_ps_load(result: dict) -> None:
    assert result["errors"] == 0 and result["peak_rss_bytes"] > 0
    assert result["rows_bounded_by_capacity"]
    assert [r["clients"] for r in result["runs"]] == [1, 2]
    assert all(r["ops"] > 0 and r["p99_ms"] >= r["p50_ms"] for r in result["runs"])
    assert result["runs"][-1]["evicted"] > 0


def _check_hash_flood(result: dict) -> None:
    # Machine-independent: ids crafted for the public index all probe from one slot.
    assert result["before_fix"]["probe_bound"] > result["ids"]
    assert result["keyed_probe_bound"] < result["ids"] // 4


def _check_recovery(result: dict) -> None:
    for key in ("ps_recovery_s", "embedding_worker_recovery_s", "data_loader_recovery_s",
                "nn_worker_recovery_s"):
        assert result[key] is not None and result[key] >= 0, (key, result)


def _check_scaling(result: dict) -> None:
    # one job per value of each factor, the base shared; every figure measured
    assert [(p["varied"], p["num_ps"]) for p in result["points"]] == [("base", 1), ("num_ps", 2)]
    assert result["shared_memory"] is True  # the default, as one host runs a job
    for point in result["points"]:
        assert point["samples"] > 0 and point["step_ms_p99"] >= point["step_ms_p50"] > 0
        assert point["cpu_per_1000_samples"]["all"] > 0
        assert 0 < point["table_rows_held"] <= point["table_rows"]
        if result["network_unavailable"] is None:  # else it says why
            assert point["network_bytes_per_sample"] > 0
        else:
            assert point["network_bytes_per_sample"] is None


def _check_disk_tier(result: dict) -> None:
    # Most of Adult's rows went to disk and back; training matched all-in-RAM.
    assert result["adult_disk_row_fraction"] > 0.5 and result["adult_rows_restored"] > 0
    assert abs(result["auc_delta_adult"]) <= 0.001, result
    # Every row (most on disk) went through the checkpoint files and back.
    assert result["checkpoint_rows"] == result["rows"]
    assert result["checkpoint_rows_on_disk"] > result["rows"] // 2
    assert result["checkpoint_gb_per_s"] > 0
    assert result["disk_utilization"] > 0  # the embedding-heavy batches read from disk


def _check_disk_tier_process(result: dict) -> None:
    # The server loaded every row of the checkpoint, most onto its tier, and its Stats
    # RPC carried the tier's counters back.
    assert result["ram_rows"] + result["disk_rows"] == result["rows"]
    assert result["disk_rows"] > result["rows"] // 2 and result["fill_rows_per_s"] > 0
    assert 0 < result["hit_rate"] <= 1 and 0 < result["hit_rate_ceiling"] <= 1
    assert result["ram_bytes_per_disk_row"] > 0 and result["read_amplification"] >= 1
    assert result["disk_utilization"] > 0 and result["disk_utilization_no_prefetch"] > 0


def _check_checkpoint(result: dict) -> None:
    # The ratios issue 43's checkpoint bars are read from, with their durable (fsync) and
    # on-device (page cache dropped) variants.
    for key in ("dump_ratio", "dump_ratio_fsync", "load_ratio", "load_ratio_cold",
                "load_rows_per_s"):
        assert result[key] > 0, (key, result)


CHECKS = {"ps_load": _check_ps_load, "hash_flood": _check_hash_flood,
          "recovery": _check_recovery, "scaling": _check_scaling,
          "checkpoint": _check_checkpoint,
          "disk_tier": _check_disk_tier, "disk_tier_process": _check_disk_tier_process}
"""What a smoke run's figures must show beyond a clean exit, where that is machine-free."""


@pytest.mark.processes
@pytest.mark.xdist_group("benchmark_smoke")
@pytest.mark.parametrize("name", BENCHMARK_NAMES)
def test_benchmark_smoke(name: str, smoke_runs: dict[str, Future[SmokeRun]]) -> None:
    run = smoke_runs[name].result(timeout=TIMEOUT_S * (len(smoke_runs) + 1))
    print(f"benchmarks.{name} --smoke: {run.seconds:.1f} s")
    assert run.returncode == 0, f"exit {run.returncode}:\n{run.output[-6000:]}"
    assert run.json_path.exists(), f"no {run.json_path.name} written:\n{run.output[-3000:]}"
    result = json.loads(run.json_path.read_text())
    if name in CHECKS:
        CHECKS[name](result)


def test_a_comparison_side_never_runs_kernels_cached_from_older_sources(tmp_path: Path) -> None:
    # numba checks a cached kernel against its own file only; the cache is chosen by all.
    from benchmarks.train_throughput import numba_cache_dir
    for sub in ("persia_py", "servers/deep"):
        (tmp_path / sub).mkdir(parents=True)
        (tmp_path / sub / "kernels.py").write_text("x = 1\n")
    first = numba_cache_dir(tmp_path)
    assert numba_cache_dir(tmp_path) == first
    callee = tmp_path / "servers" / "deep" / "kernels.py"
    callee.write_text("x = 2\n")
    os.utime(callee, ns=(1, 1))
    second = numba_cache_dir(tmp_path)
    assert second != first
    callee.write_text("x = 22\n")
    os.utime(callee, ns=(1, 1))  # same time, other size
    assert numba_cache_dir(tmp_path) not in (first, second)

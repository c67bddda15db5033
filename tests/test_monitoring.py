"""Every role of a local run serves Prometheus metrics with plausible values; rank 0
writes its JSON-lines training log; a config error stops ``local`` before any process."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
from checkout import EXAMPLE
from child_processes import RoleProcess, launcher_command, processes_with_marker
from prometheus_client.parser import text_string_to_metric_families

from persia_py.ops.start_checks import CONFIG_EXIT_CODE

pytestmark = pytest.mark.processes

_METRICS_LINE = r"^\[(?P<role>[\w-]+)\] .* metrics on (?P<url>http://\S+/metrics)"


def _scrape(url: str) -> dict[str, float]:
    """Every sample of the endpoint as ``name{labels}`` -> value (labels sorted)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def _matching(samples: dict[str, float], prefix: str) -> list[float]:
    return [v for k, v in samples.items() if k.startswith(prefix)]


def _plausible(role: str, m: dict[str, float]) -> bool:
    if role.startswith("ps-"):
        return (sum(_matching(m, "persia_ps_entries{")) > 0 and m["persia_ps_entries_total"] > 0
                and m["persia_ps_bytes_total"] > 0 and m["persia_ps_lookup_seconds_count"] > 0
                and m["persia_ps_update_seconds_count"] > 0
                and all(0 <= v <= 1 for v in _matching(m, "persia_ps_index_miss_ratio"))
                and _matching(m, "persia_ps_evictions_total{") != [])
    if role.startswith("embedding-worker"):
        return (m["persia_embedding_worker_lookup_seconds_count{phase=rpc}"] > 0
                and m["persia_embedding_worker_lookup_seconds_count{phase=pre}"] > 0
                and m["persia_embedding_worker_lookup_seconds_count{phase=post}"] > 0
                and "persia_embedding_worker_pending_batches" in m
                and "persia_embedding_worker_staleness" in m
                and len(_matching(m, "persia_embedding_worker_nan_grad_skipped_total{")) == 26)
    if role == "launcher":  # nothing died: no restart counted (see tests/test_chaos.py)
        return not _matching(m, "persia_restarts_total")
    if role.startswith("data-loader"):
        return m["persia_data_loader_batches_total"] > 0 and m["persia_data_loader_samples_total"] > 0
    return (m["persia_nn_worker_samples_per_second"] > 0 and m["persia_nn_worker_steps_total"] > 0
            and m["persia_nn_worker_forward_seconds_count"] > 0
            and m["persia_nn_worker_backward_seconds_count"] > 0
            and m["persia_nn_worker_wait_seconds_count"] > 0
            and "persia_nn_worker_staleness" in m and m["persia_nn_worker_loss"] > 0)


def test_every_role_serves_metrics_and_rank0_writes_a_training_log(tmp_path) -> None:
    job = RoleProcess(launcher_command(
        "local", "--nn-worker", str(EXAMPLE / "train.py"),
        "--data-loader", str(EXAMPLE / "data_loader.py"),
        "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
        "--global-config", str(EXAMPLE / "global_config.yml"),
        "--run-dir", str(tmp_path / "run"), "--data-loader-args", "--train-samples 10000000",
        "--env", "PERSIA_LOG_EVERY=20",
    ))
    try:
        endpoints: dict[str, str] = {}
        for _ in range(5):  # the launcher, ps-0, embedding-worker-0, data-loader-0, rank 0
            match = job.wait_for_line(_METRICS_LINE, timeout=120)
            endpoints[match.group("role")] = match.group("url")
        assert sorted(endpoints) == ["data-loader-0", "embedding-worker-0", "launcher",
                                     "nn-worker", "ps-0"]
        job.wait_for_line(r"\[nn-worker\] step 20 \| \d+ samples \| [\d,]+ samples/s \| loss",
                          timeout=120)
        pending = dict(endpoints)
        for _ in range(10):  # re-scrape after each progress line until all are plausible
            for role, url in list(pending.items()):
                if _plausible(role, _scrape(url)):
                    del pending[role]
            if not pending:
                break
            job.wait_for_line(r"\[nn-worker\] step \d+ \|", timeout=60)
        assert not pending, {role: _scrape(url) for role, url in pending.items()}

        records = [json.loads(line)
                   for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
        assert len(records) >= 20 and [r["step"] for r in records[:3]] == [1, 2, 3]
        assert records[-1]["samples"] > 0 and records[-1]["samples_per_sec"] > 0
        assert all(r["loss"] > 0 and r["staleness"] >= 0 for r in records)
        assert job.interrupt(timeout=60) != 0
        assert processes_with_marker(job.marker) == []
    finally:
        job.stop()


def test_local_refuses_a_bad_config_before_starting_anything(tmp_path) -> None:
    bad = tmp_path / "embedding_config.yml"
    bad.write_text("slots_config:\n  a:\n    dimm: 8\n")
    job = RoleProcess(launcher_command(
        "local", "--nn-worker", str(EXAMPLE / "train.py"),
        "--data-loader", str(EXAMPLE / "data_loader.py"), "--embedding-config", str(bad),
        "--run-dir", str(tmp_path / "run")))
    try:
        assert job.wait(timeout=60) == CONFIG_EXIT_CODE  # final: never restarted
        out = job.output()
        assert re.search(rf"config error: {re.escape(str(bad))}: slots_config\.a\.dimm: unknown "
                         r"key .*did you mean 'dim'\?", out), out
        assert "[ps-0]" not in out and not (tmp_path / "run").exists()
    finally:
        job.stop()

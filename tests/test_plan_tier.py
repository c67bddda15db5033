"""``persia-launcher plan --machine-disk``: a RAM and a disk budget per server, and a real
parameter server with a disk tier holds what the plan says (RSS and file bytes)."""

from __future__ import annotations

import json

import pytest

from benchmarks.density import SLOT, fill_server
from persia_py.launcher.cli import main
from persia_py.launcher.plan import Machine, TableDemand, Workload
from persia_py.launcher.plan_tier import DiskBudget, make_tier_plan, tier_server

EMBEDDING = "slots_config:\n  user: {dim: 32}\n  item: {dim: 16}\n"


def _plan(tmp_path, capsys, *args: str) -> dict:
    config = tmp_path / "embedding_config.yml"
    config.write_text(EMBEDDING)
    assert main(["plan", "--embedding-config", str(config), "--ids", "user=4e10",
                 "--ids", "item=1e10", "--optimizer", "rowwise-adagrad", "--row-dtype",
                 "float16", "--machine-memory", "256GiB", "--nn-workers", "8", *args]) == 0
    return json.loads(capsys.readouterr().out) if "--json" in args else {
        "text": capsys.readouterr().out}


def test_plan_with_a_disk_budget_fills_ram_first_and_fits_both(tmp_path, capsys) -> None:
    plan = _plan(tmp_path, capsys, "--json", "--machine-disk", "4TB",
                 "--samples-per-second", "10000", "--ram-hit-rate", "0.8")
    tier = plan["disk_tier"]
    memory = tier["memory_per_server"]
    assert memory["total"] <= 256 * 2**30 * 0.9 and memory["disk_bytes"] <= 4e12
    # Fewer servers than RAM alone needs; the rows they hold are the job's.
    assert tier["parameter_servers"] < plan["parameter_servers"]
    assert 0 < tier["ram_row_share"] < 1 and memory["disk_rows"] > memory["rows"]
    assert memory["rows"] + memory["disk_rows"] >= 5e10 / tier["parameter_servers"]
    capacity = tier["config"]["capacity"]
    assert set(capacity) == {"user", "item"} and tier["config"]["disk_tier"]["capacity_rows"] > 0
    # 8 workers x 10k samples x 2 ids x 20 % misses, spread over the servers.
    assert tier["random_reads_per_s_per_server"] == pytest.approx(
        8 * 10_000 * 2 * 0.2 / tier["parameter_servers"])
    # One server fewer does not fit: the RAM or the disk budget is what binds.
    table = [TableDemand(name=n, dim=d, distinct_ids=int(i), capacity=None, state_width=1,
                         row_dtype="float16") for n, d, i in (("user", 32, 4e10),
                                                              ("item", 16, 1e10))]
    fewer = make_tier_plan(table, machine=Machine(memory_bytes=256 * 2**30, cores=32),
                           workload=Workload(num_nn_workers=8),
                           budget=DiskBudget(disk_bytes=int(4e12)))
    assert fewer["parameter_servers"] == tier["parameter_servers"]
    text = _plan(tmp_path, capsys, "--machine-disk", "4TB")["text"]
    assert "with a disk tier:" in text and "give --samples-per-second" in text


def test_plan_refuses_a_bad_disk_budget(tmp_path, capsys) -> None:
    config = tmp_path / "embedding_config.yml"
    config.write_text(EMBEDDING)
    with pytest.raises(SystemExit, match="disk bytes must be > 0, got 0"):
        main(["plan", "--embedding-config", str(config), "--ids-all", "1e6",
              "--machine-memory", "1GiB", "--machine-disk", "0"])
    with pytest.raises(SystemExit, match="ram hit rate must lie in"):
        main(["plan", "--embedding-config", str(config), "--ids-all", "1e6",
              "--machine-memory", "1GiB", "--machine-disk", "1GB", "--ram-hit-rate", "2"])


@pytest.mark.processes
def test_a_filled_parameter_server_with_a_tier_holds_what_the_plan_says(tmp_path) -> None:
    """A real server (its own process, as the launcher starts it) with a quarter of its
    rows in RAM and the rest on its disk tier: resident memory and the tier file's
    allocated bytes within 10 % of the plan for the same table and calls."""
    rows, ram_rows, chunk = 3_000_000, 750_000, 50_000
    measured = fill_server(tmp_path, dim=32, optimizer="rowwise-adagrad", rows=rows,
                           row_dtype="float16", chunk=chunk, ram_rows=ram_rows,
                           disk_rows=rows - ram_rows)
    table = TableDemand(name=SLOT, dim=32, distinct_ids=rows, capacity=None, state_width=1,
                        row_dtype="float16")
    planned = tier_server([table], 1, Workload(batch_size=chunk, staleness=1),
                          {SLOT: ram_rows}, rows - ram_rows)
    assert ram_rows * 15 // 16 <= measured["rows"] <= ram_rows
    assert abs(measured["disk_file_bytes"] / planned["disk_bytes"] - 1) <= 0.10, (
        measured, planned)
    assert abs(measured["rss_bytes"] / planned["total"] - 1) <= 0.10, (measured, planned)

"""``persia-launcher plan``: its bytes are the storage's, and a real server agrees."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.density import fill_server, planned_bytes
from persia_py.launcher.cli import main
from persia_py.launcher.plan import (
    OPTIMIZERS,
    PROCESS_BYTES,
    Machine,
    TableDemand,
    Workload,
    make_plan,
    server_memory,
)
from persia_py.launcher.plan_cli import parse_bytes
from persia_py.servers import sizing
from persia_py.servers.optimizers import optimizer_from_dict, state_width
from persia_py.servers.storage import EmbeddingTable

EMBEDDING = """\
feature_groups:
  pair: [a, b]
slots_config:
  a: {dim: 16, capacity: 100000000000}
  b: {dim: 16, capacity: 100000000000}
  c: {dim: 64, capacity: 100000000000, optimizer: {type: sgd, lr: 0.1}}
"""


def _plan_json(tmp_path, *args: str, capsys, embedding: str = EMBEDDING) -> dict:
    config = tmp_path / "embedding_config.yml"
    config.write_text(embedding)
    assert main(["plan", "--embedding-config", str(config), "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise-adagrad", "adam"])
def test_table_bytes_are_what_a_table_allocates(optimizer) -> None:
    cfg = optimizer_from_dict(OPTIMIZERS[optimizer])
    with EmbeddingTable(dim=16, optimizer=cfg, capacity=1 << 20) as table:
        ids = np.random.default_rng(1).integers(0, 2**63, 70_000, dtype=np.uint64)
        table.lookup(ids, insert=True)
        rows = table.num_entries
        assert table.stats()["bytes"] == sizing.table_bytes(rows, 16, state_width(cfg, 16)).total


def test_plan_json_sizes_servers_to_the_machine(tmp_path, capsys) -> None:
    plan = _plan_json(tmp_path, "--ids", "a=3e9", "--ids", "b=1e9", "--ids-all", "5e8",
                      "--machine-memory", "256GiB", "--optimizer", "adagrad", capsys=capsys)
    tables = {t["name"]: t for t in plan["tables"]}
    # a and b share the table of their group; c keeps its own optimizer (SGD: no state).
    assert tables["pair"]["distinct_ids"] == 4_000_000_000 and tables["pair"]["state_width"] == 16
    assert tables["c"]["distinct_ids"] == 500_000_000 and tables["c"]["state_width"] == 0
    memory = plan["memory_per_server"]
    assert memory["total"] <= 256 * 2**30 * 0.9
    assert memory["process"] == PROCESS_BYTES
    demands = [TableDemand(**{k: v for k, v in t.items() if k != "rows_per_server"})
               for t in plan["tables"]]
    fewer = server_memory(demands, plan["parameter_servers"] - 1, Workload())
    assert fewer["total"] > 256 * 2**30 * 0.9  # one server fewer would not fit
    assert memory["weights"] == sum(t["rows_per_server"] * t["dim"] * 4 for t in plan["tables"])


def test_half_precision_rows_and_rowwise_state_need_fewer_servers(tmp_path, capsys) -> None:
    args = ("--ids-all", "2e9", "--machine-memory", "64GiB")
    fp32 = _plan_json(tmp_path, *args, capsys=capsys)
    fp16 = _plan_json(tmp_path, *args, "--row-dtype", "float16", "--optimizer",
                      "rowwise-adagrad", capsys=capsys)
    assert fp16["parameter_servers"] <= fp32["parameter_servers"] / 2
    tables = {t["name"]: t for t in fp16["tables"]}
    assert tables["pair"]["state_width"] == 1
    assert fp16["bytes_per_parameter"] < fp32["bytes_per_parameter"] / 2


def test_each_table_is_planned_in_its_configured_row_dtype(tmp_path, capsys) -> None:
    # The file's default (float16) for the pair, c's own float32; --row-dtype overrides both.
    mixed = EMBEDDING.replace("lr: 0.1}}", "lr: 0.1}, row_dtype: float32}") + "row_dtype: float16\n"
    args = ("--ids-all", "1e9", "--machine-memory", "256GiB")
    plans = {name: _plan_json(tmp_path, *args, *extra, capsys=capsys, embedding=mixed)
             for name, extra in (("config", ()), ("fp32", ("--row-dtype", "float32")),
                                 ("bf16", ("--row-dtype", "bfloat16")))}
    dtypes = {name: {t["name"]: t["row_dtype"] for t in plan["tables"]}
              for name, plan in plans.items()}
    assert dtypes == {"config": {"pair": "float16", "c": "float32"},
                      "fp32": {"pair": "float32", "c": "float32"},
                      "bf16": {"pair": "bfloat16", "c": "bfloat16"}}
    assert plans["config"]["row_dtype"] == "float16/float32"
    for plan in plans.values():
        tables = plan["tables"]
        weights = sum(t["rows_per_server"] * t["dim"] * (4 if t["row_dtype"] == "float32" else 2)
                      for t in tables)
        assert plan["memory_per_server"]["weights"] == weights
    assert (plans["bf16"]["bytes_per_parameter"] < plans["config"]["bytes_per_parameter"]
            < plans["fp32"]["bytes_per_parameter"])
    with pytest.raises(ValueError, match="table t: row_dtype must be one of"):
        TableDemand(name="t", dim=8, distinct_ids=1, capacity=1, state_width=0, row_dtype="f8")


def test_sample_counts_distinct_ids_and_extrapolates(tmp_path, capsys) -> None:
    sample = tmp_path / "sample.csv"
    lines = ["label,a,b,c,extra"]
    lines += [f"1,x{i % 10},y{i},z{i % 3},w" for i in range(1000)]
    sample.write_text("\n".join(lines) + "\n")
    plan = _plan_json(tmp_path, "--sample", str(sample), "--machine-memory", "16GiB",
                      capsys=capsys)
    tables = {t["name"]: t for t in plan["tables"]}
    assert tables["pair"]["distinct_ids"] == 10 + 1000 and tables["c"]["distinct_ids"] == 3
    # Data 100 times the sample: b's ids are all new in every half (grows 100-fold), a's
    # and c's were all seen in the first half (do not grow).
    plan = _plan_json(tmp_path, "--sample", str(sample), "--sample-scale", "100",
                      "--machine-memory", "16GiB", capsys=capsys)
    tables = {t["name"]: t for t in plan["tables"]}
    assert tables["pair"]["distinct_ids"] == 10 + 100_000 and tables["c"]["distinct_ids"] == 3


def test_text_plan_and_errors(tmp_path, capsys) -> None:
    config = tmp_path / "embedding_config.yml"
    config.write_text(EMBEDDING)
    base = ["plan", "--embedding-config", str(config), "--machine-memory", "1TB"]
    assert main([*base, "--ids-all", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "parameter servers:" in out and "hash index" in out and "data loader" in out
    with pytest.raises(SystemExit, match="no distinct-id count for slot"):
        main([*base, "--ids", "a=10"])
    with pytest.raises(SystemExit, match=r"slots \['nope'\] that embedding_config lacks"):
        main([*base, "--ids-all", "10", "--ids", "nope=3"])
    assert parse_bytes("12TB") == 12 * 10**12 and parse_bytes("256GiB") == 256 * 2**30
    with pytest.raises(ValueError, match="no number of parameter servers fits"):
        make_plan([TableDemand(name="t", dim=8, distinct_ids=10, capacity=10, state_width=0)],
                  machine=Machine(memory_bytes=100 << 20, cores=4),
                  workload=Workload())


@pytest.mark.processes
@pytest.mark.parametrize(("row_dtype", "optimizer"),
                         [("float32", "adagrad"), ("float16", "rowwise-adagrad")])
def test_a_filled_parameter_server_holds_what_the_plan_says(tmp_path, row_dtype,
                                                            optimizer) -> None:
    # A real server started as the launcher starts it, filled by training lookups; its
    # resident memory (VmRSS) against the plan's figure for the same table and calls.
    measured = fill_server(tmp_path, dim=32, optimizer=optimizer, rows=2_000_000,
                           row_dtype=row_dtype)
    planned = planned_bytes(dim=32, optimizer=optimizer, rows=2_000_000, row_dtype=row_dtype)
    assert measured["rows"] == 2_000_000
    # The server stores what it was configured with (half the weights' bytes in float16).
    assert measured["table_bytes"] == sizing.table_bytes(
        2_000_000, 32, 1 if optimizer == "rowwise-adagrad" else 32,
        weight_bytes=2 if row_dtype == "float16" else 4).total
    assert abs(measured["rss_bytes"] / planned - 1) <= 0.10, (measured, planned)


def test_a_table_without_capacity_is_planned_within_the_capacity_a_server_derives() -> None:
    """The servers are counted so that an unset table's rows per server stay within the
    bound each server derives from its memory (servers/sizing.py), as it will at run time."""
    from persia_py.launcher.plan import derived_capacity, rows_per_replica

    table = TableDemand(name="t", dim=16, distinct_ids=10**9, capacity=None, state_width=16)
    machine, workload = Machine(memory_bytes=64 << 30, cores=64), Workload()
    plan = make_plan([table], machine=machine, workload=workload)
    bound = derived_capacity([table], machine)
    assert bound == sizing.derived_capacity([table.row_bytes], 0, sizing.MemoryLimit(64 << 30, ""))
    (planned,) = plan["tables"]
    assert planned["rows_per_server"] <= bound and plan["tables_evicting"] == []
    # One server fewer would hold more rows each than the bound (it is what counts here).
    fewer = plan["parameter_servers"] - 1
    assert rows_per_replica(table, fewer) > bound
    assert any("capacity unset for t:" in note for note in plan["notes"]), plan["notes"]

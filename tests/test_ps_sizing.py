"""A parameter server whose configured capacity, full, outgrows the memory it can have
warns at start with the figures (and again, with the optimizer's state, when training
configures it); a table whose capacity is unset is bounded by that memory instead, so
the docs' configs start without a warning. The memory is the least of the cgroup limits
(the process's group and its ancestors) and the machine's (MemTotal)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from child_processes import start_server

from persia_py.config import embedding_config_from_dict, global_config_from_dict
from persia_py.servers.optimizers import optimizer_from_dict, state_width
from persia_py.servers.parameter_server import ParameterServer
from persia_py.servers.sizing import (
    MemoryLimit,
    TableSize,
    capacity_warning,
    memory_limit,
    row_bytes,
    table_sizes,
)

EMBEDDING = {"slots_config": {"user": {"dim": 32}, "item": {"dim": 8}}}
ADAM = {"type": "adam", "lr": 0.01}


def test_row_bytes_by_dim_and_optimizer() -> None:
    adagrad = optimizer_from_dict({"type": "adagrad", "lr": 0.01})
    # dim 32: weights 128 B, id + stamp 10 B, index 8 B; Adagrad adds 128 B.
    assert row_bytes(32, 0) == 146
    assert row_bytes(32, state_width(adagrad, 32)) == 274
    assert row_bytes(32, state_width(optimizer_from_dict(ADAM), 32)) == 4 * (32 + 65) + 18


def test_half_rows_count_two_bytes_a_weight_as_the_tables_allocate_them() -> None:
    rowwise = optimizer_from_dict({"type": "adagrad", "vectorwise_shared": True})
    assert row_bytes(64, state_width(rowwise, 64), weight_bytes=2) == 2 * 64 + 4 + 18
    servers = {}
    for row_dtype in ("float32", "float16", "bfloat16"):
        ps = servers[row_dtype] = ParameterServer(global_config_from_dict({}), (
            embedding_config_from_dict(dict(EMBEDDING, row_dtype=row_dtype))))
        sizes = {t.name: t.row_bytes
                 for t in table_sizes(ps.embedding_config, ps.global_config, None)}
        weight = 4 if row_dtype == "float32" else 2
        assert sizes == {"user": row_bytes(32, 0, weight), "item": row_bytes(8, 0, weight)}
        ps.configure(optimizer={"type": "sgd", "lr": 0.1})
        ps.lookup([("user", np.arange(1, 5001, dtype=np.uint64))], training=True)
    full = servers["float32"].stats()["user"]["bytes"]
    for row_dtype in ("float16", "bfloat16"):  # the same index, half the weights
        assert full - servers[row_dtype].stats()["user"]["bytes"] == 5000 * 32 * 2


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_memory_limit_is_the_least_of_the_cgroup_limits_and_the_machines(tmp_path) -> None:
    _write(tmp_path / "proc/meminfo", "MemTotal: 99999 kB\nMemAvailable:   2048 kB\n")
    machine = MemoryLimit(99999 * 1024, "the machine's memory, MemTotal in /proc/meminfo")
    assert memory_limit(str(tmp_path)) == machine  # not what happens to be free now
    # cgroup v2, the process's own group.
    _write(tmp_path / "proc/self/cgroup", "0::/jobs/ps\n")
    _write(tmp_path / "sys/fs/cgroup/jobs/ps/memory.max", "1048576\n")
    assert memory_limit(str(tmp_path)) == MemoryLimit(1 << 20, "the cgroup limit (memory.max)")
    _write(tmp_path / "sys/fs/cgroup/jobs/ps/memory.max", "max\n")
    assert memory_limit(str(tmp_path)) == machine
    _write(tmp_path / "sys/fs/cgroup/jobs/memory.max", "786432\n")  # an ancestor's limit binds
    assert memory_limit(str(tmp_path)).bytes == 786432
    # cgroup v1; the kernel's "no limit" is a number near 2**63.
    _write(tmp_path / "proc/self/cgroup", "4:memory:/pod\n1:cpu:/\n")
    _write(tmp_path / "sys/fs/cgroup/memory/pod/memory.limit_in_bytes", "524288\n")
    assert memory_limit(str(tmp_path)) == MemoryLimit(
        524288, "the cgroup limit (memory.limit_in_bytes)")
    _write(tmp_path / "sys/fs/cgroup/memory/pod/memory.limit_in_bytes", "9223372036854771712")
    assert memory_limit(str(tmp_path)) == machine
    # A container whose group is mounted as the root: its path is not under the mount.
    _write(tmp_path / "proc/self/cgroup", "4:memory:/docker/abc\n")
    _write(tmp_path / "sys/fs/cgroup/memory/memory.limit_in_bytes", "262144\n")
    assert memory_limit(str(tmp_path)).bytes == 262144
    assert memory_limit(str(tmp_path / "nothing")) is None


def test_an_unset_capacity_is_as_many_rows_as_the_memory_allows() -> None:
    from persia_py.servers.sizing import (
        MIN_DERIVED_ROWS,
        TABLE_MEMORY_SHARE,
        UNKNOWN_MEMORY_CAPACITY,
        derived_capacity,
    )

    limit = MemoryLimit(8 << 30, "the cgroup limit (memory.max)")
    room = int((8 << 30) * TABLE_MEMORY_SHARE)
    # Every unset table gets the same rows; together, full, they take the share.
    assert derived_capacity([146, 82], 0, limit) == room // (146 + 82)
    # Tables whose capacity is set take their full size first.
    assert derived_capacity([146], 1 << 30, limit) == (room - (1 << 30)) // 146
    # Set ones that leave no room: the floor (and they warn); no memory figure: 10^9.
    assert derived_capacity([146], 100 << 30, limit) == MIN_DERIVED_ROWS
    assert derived_capacity([146], 0, None) == UNKNOWN_MEMORY_CAPACITY

    embedding = embedding_config_from_dict({"slots_config": {
        "user": {"dim": 32}, "item": {"dim": 8}, "small": {"dim": 8, "capacity": 1000}}})
    sizes = {t.name: t for t in table_sizes(embedding, global_config_from_dict({}), ADAM,
                                            limit)}
    unset = [row_bytes(32, 65), row_bytes(8, 17)]
    rows = derived_capacity(unset, 1000 * row_bytes(8, 17), limit)
    assert (sizes["user"].capacity, sizes["item"].capacity, sizes["small"].capacity) == (
        rows, rows, 1000)
    assert not sizes["user"].configured and sizes["small"].configured
    assert capacity_warning(list(sizes.values()), limit, what="") is None


def test_a_parameter_server_bounds_unset_tables_by_its_memory_and_says_so(caplog) -> None:
    from persia_py.servers.sizing import derived_capacity

    server = ParameterServer(global_config_from_dict({}), embedding_config_from_dict(EMBEDDING))
    assert server.memory == memory_limit()
    with caplog.at_level(logging.INFO, logger="persia_py.servers.parameter_server"):
        server.configure(optimizer=ADAM)
        server.configure(optimizer=ADAM)  # a repeat says nothing again
    rows = derived_capacity([row_bytes(32, 65), row_bytes(8, 17)], 0, server.memory)
    assert {name: t.capacity for name, t in server._tables.items()} == {
        "user": rows, "item": rows}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"parameter server 0: capacity unset for table(s) user, "
                                  f"item: {rows:,} rows each"), messages
    assert caplog.records[0].levelno == logging.INFO


def test_warning_names_the_figures_and_what_to_change() -> None:
    tables = [TableSize("user", 10_000_000, 304), TableSize("item", 1_000_000, 80)]
    limit = MemoryLimit(2 << 30, "the cgroup limit (memory.max)")
    message = capacity_warning(tables, limit, what="weights, optimizer state and index")
    assert message.startswith("the configured capacity of this parameter server's 2 "
                              "table(s), full, takes 2.9 GiB (weights, optimizer state and "
                              "index), more than the 2.0 GiB it can have (the cgroup limit "
                              "(memory.max)); largest: user: 10,000,000 rows x 304 B = 2.8 GiB")
    assert "lower embedding_parameter_server_config.capacity" in message
    assert capacity_warning(tables, MemoryLimit(3 << 30, "x"), what="") is None
    assert capacity_warning(tables, None, what="") is None


def _server(capacity: int) -> ParameterServer:
    config = global_config_from_dict(
        {"embedding_parameter_server_config": {"capacity": capacity}})
    return ParameterServer(config, embedding_config_from_dict(EMBEDDING))


def test_parameter_server_warns_at_start_and_at_configure(caplog) -> None:
    available = memory_limit()
    if available is None:
        pytest.fail("no memory figure on this machine: /proc/meminfo is unreadable")
    # Rows of the two tables without optimizer state: a capacity just above what fits.
    too_many = available.bytes // (row_bytes(32, 0) + row_bytes(8, 0)) + 1
    with caplog.at_level(logging.WARNING, logger="persia_py.servers.parameter_server"):
        server = _server(too_many)
    start = [r.getMessage() for r in caplog.records]
    assert len(start) == 1 and "weights and index only" in start[0], start
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="persia_py.servers.parameter_server"):
        server.configure(optimizer=ADAM)
    assert any("weights, optimizer state and index" in r.getMessage() for r in caplog.records)
    # A capacity that fits with the optimizer's state says nothing.
    fits = available.bytes // (row_bytes(32, 65) + row_bytes(8, 17)) // 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="persia_py.servers.parameter_server"):
        _server(fits).configure(optimizer=ADAM)
    assert caplog.records == []


@pytest.mark.processes
def test_a_parameter_server_process_prints_the_warning_at_start(tmp_path) -> None:
    (tmp_path / "embedding_config.yml").write_text(
        "slots_config:\n  user:\n    dim: 32\n")
    (tmp_path / "global_config.yml").write_text(
        "embedding_parameter_server_config:\n  capacity: 1000000000000\n")
    ps, _ = start_server("embedding-parameter-server",
                         "--embedding-config", str(tmp_path / "embedding_config.yml"),
                         "--global-config", str(tmp_path / "global_config.yml"))
    try:
        output = ps.output()
        row = row_bytes(32, 0)
        assert (f"1,000,000,000,000 rows x {row} B = {row * 10**12 / 2**30:,.1f} GiB"
                in output), output
        assert "it can have (" in output and "lower embedding_parameter_server_config" in output
    finally:
        ps.stop()


def test_only_the_configured_capacities_are_weighed_against_the_memory(caplog) -> None:
    """A slot whose capacity is set past the memory warns, naming it alone; the slot
    beside it with none set is bounded by the memory, not counted as a plan."""
    available = memory_limit()
    too_many = available.bytes // row_bytes(32, 0) + 1
    embedding = embedding_config_from_dict({"slots_config": {
        "user": {"dim": 32, "capacity": too_many}, "item": {"dim": 8}}})
    with caplog.at_level(logging.WARNING, logger="persia_py.servers.parameter_server"):
        ParameterServer(global_config_from_dict({}), embedding)
    (message,) = [r.getMessage() for r in caplog.records]
    assert "capacity of this parameter server's 1 table(s)" in message, message
    assert f"user: {too_many:,} rows" in message and "item:" not in message, message


def _doc_configs(tmp_path):
    """The README's first job's embedding config, and docs/online_training.md's
    embedding and global configs (its /data/job a folder of the test's)."""
    from test_doc_pages import EMBEDDING_CONFIG, GLOBAL_CONFIG
    from test_readme import first_job

    readme = tmp_path / "readme"
    readme.mkdir()
    (readme / "embedding_config.yml").write_text(first_job()[0]["embedding_config.yml"])
    online = tmp_path / "online"
    (online / "job").mkdir(parents=True)
    (online / "embedding_config.yml").write_text(EMBEDDING_CONFIG)
    (online / "global_config.yml").write_text(
        GLOBAL_CONFIG.replace("/data/job", str(online / "job")))
    return [("README", ["--embedding-config", str(readme / "embedding_config.yml")]),
            ("online_training.md", ["--embedding-config", str(online / "embedding_config.yml"),
                                    "--global-config", str(online / "global_config.yml")])]


@pytest.mark.processes
def test_the_docs_configs_start_a_parameter_server_without_a_warning(tmp_path) -> None:
    from persia_py.config import CommonConfig
    from persia_py.workers.ps_client import PSClient, configure_request

    for page, flags in _doc_configs(tmp_path):
        ps, port = start_server("embedding-parameter-server", *flags)
        client = PSClient(f"127.0.0.1:{port}", CommonConfig())
        try:  # the train scripts' optimizer: its state counted too
            client.configure(configure_request({"type": "adagrad", "lr": 0.05}, init_lower=-0.01,
                                               init_upper=0.01, weight_bound=None, seed=0))
            client.lookup([("user", np.arange(1, 11, dtype=np.uint64))], training=True)
        finally:
            client.close()
            ps.stop()
        output = ps.output()
        assert "WARNING" not in output and "will be killed" not in output, (page, output)
        assert "Traceback" not in output, (page, output)
        if page == "online_training.md":  # no capacity set: bounded by the memory, said once
            assert output.count("capacity unset for table(s) user, item: ") == 1, output

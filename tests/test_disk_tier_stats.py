"""The parameter server's Stats RPC carries each table's disk-tier counters (issue 42), so
a client in another process (``benchmarks.disk_tier --process``) reads the tier's hit
rate, sizes and reads from the server itself."""

from __future__ import annotations

import numpy as np

from persia_py.config import (
    DiskTierConfig,
    EmbeddingTablesConfig,
    GlobalConfig,
    ParameterServerConfig,
    SlotConfig,
)
from persia_py.proto import parameter_server_pb2 as pb
from persia_py.servers.parameter_server import ParameterServer
from persia_py.servers.service import create_ps_server
from persia_py.workers.ps_client import PSClient


def _served(config: GlobalConfig) -> tuple[ParameterServer, object, PSClient]:
    ps = ParameterServer(config, EmbeddingTablesConfig(slots_config={"user": SlotConfig(dim=4)}))
    ps.configure(optimizer={"type": "sgd", "lr": 1.0})
    server, port = create_ps_server(ps, "127.0.0.1:0")
    return ps, server, PSClient(f"127.0.0.1:{port}", config.common_config)


def test_stats_carries_the_tiers_counters_over_grpc(tmp_path) -> None:
    config = GlobalConfig(embedding_parameter_server_config=ParameterServerConfig(
        capacity=256, disk_tier=DiskTierConfig(path=str(tmp_path), capacity_rows=2_000)))
    ps, server, client = _served(config)
    try:
        (table,) = ps.stats()
        ids = np.arange(1, 1_201, dtype=np.uint64)
        for part in np.split(ids, 6):  # 1,200 rows through 256 in RAM: most spill
            client.lookup([(table, part)], training=True)
        client.lookup([(table, ids[:100])], training=False)  # the first spilled come back
        (got,) = client.stats().tables
        assert got.HasField("disk")
        expected = ps.disk_stats()[table]
        # Every counter the table keeps travels (a new one needs its field in the proto).
        assert set(expected) == set(pb.DiskTierStats.DESCRIPTOR.fields_by_name)
        assert {k: getattr(got.disk, k) for k in expected} == expected
        assert got.disk.disk_rows > 900 and got.disk.disk_hits == 100
        assert got.disk.disk_block_reads > 0 and got.disk.disk_ram_bytes > 0
        assert got.disk.restored == 100 and got.disk.spilled >= got.disk.disk_rows
        assert got.entries == ps.stats()[table]["entries"] <= 256
    finally:
        client.close()
        server.stop(None)
        ps.close()


def test_stats_of_a_table_without_a_tier_has_no_disk_counters() -> None:
    ps, server, client = _served(GlobalConfig())
    try:
        (table,) = ps.stats()
        client.lookup([(table, np.arange(1, 11, dtype=np.uint64))], training=True)
        (got,) = client.stats().tables
        assert not got.HasField("disk") and got.entries == 10
    finally:
        client.close()
        server.stop(None)
        ps.close()

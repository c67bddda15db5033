"""TTL with the disk tier (issue 42): the disk's own TTL deletes rows on disk unused that
long, a slot's TTL removes a row wherever it is (or, with ``spill_expired``, moves it
from RAM to disk), stamps move with rows that compaction relocates, deletions count as
expired, travel in increments, and show on the parameter server's /metrics endpoint."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from persia_py.config import (
    ConfigError,
    DiskTierConfig,
    EmbeddingTablesConfig,
    GlobalConfig,
    ParameterServerConfig,
    SlotConfig,
    global_config_from_dict,
)
from persia_py.servers.disk_tier import DiskTier
from persia_py.servers.metrics import ParameterServerMetrics
from persia_py.servers.optimizers import AdagradConfig
from persia_py.servers.parameter_server import ParameterServer
from persia_py.servers.storage import EmbeddingTable
from persia_py.telemetry.monitoring import serve_metrics

DIM = 4


def _table(tmp_path, *, capacity: int = 16, tier: dict | None = None,
           **kwargs) -> EmbeddingTable:
    """A table with a disk tier of 1,000 rows (``tier``: more of its keys); ``kwargs``:
    the table's (its slot's TTL)."""
    return EmbeddingTable(dim=DIM, optimizer=AdagradConfig(lr=0.1), capacity=capacity,
                          seed=3, disk_tier=DiskTierConfig(path=str(tmp_path),
                                                           capacity_rows=1_000, **(tier or {})),
                          **kwargs)


def _ids(start: int, n: int = 16) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.uint64)


def _where(table: EmbeddingTable, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(in RAM, on disk) masks of ``ids``, without touching them."""
    ram = np.zeros(ids.shape[0], np.bool_)
    disk = np.zeros(ids.shape[0], np.bool_)
    for shard in table._shards:
        ram |= shard.index.find(ids) >= 0
        assert shard.tier is not None
        disk |= shard.tier.holds(ids)
    return ram, disk


def test_disk_ttl_deletes_rows_unused_that_long_and_counts(tmp_path) -> None:
    with _table(tmp_path, tier={"expire_after_steps": 32}) as t:
        t.track_changes()
        old = _ids(1)
        t.lookup(old, True)            # step 1
        t.lookup(_ids(100), True)      # step 2: ``old`` spills to disk, stamped step 1
        assert _where(t, old)[1].all()
        kept = old[:4]
        for step in range(3, 30):      # within the TTL: ``kept`` comes back, stays in use
            t.lookup(_ids(1000 + 16 * step) if step % 2 else kept, True)
        assert t.disk_stats()["disk_expired"] == 0
        for step in range(30, 40):     # past it: the rest of ``old`` leaves the disk
            t.lookup(_ids(1000 + 16 * step), True)
        ram, disk = _where(t, old[4:])
        assert not (ram | disk).any()
        assert not t.lookup(old[4:], False).any()  # read as unknown ids: zeros
        stats, disk_stats = t.stats(), t.disk_stats()
        assert disk_stats["disk_expired"] >= 12 and stats["expired"] == disk_stats["disk_expired"]
        assert stats["evicted"] == 0   # a TTL, not the disk's capacity
        _, removed = t.export_changed_rows()
        assert set(old[4:].tolist()) <= set(removed.tolist())  # increments drop them


def test_slot_ttl_removes_a_row_on_disk_too(tmp_path) -> None:
    """A slot's TTL means the row is gone, wherever it is (the default)."""
    with _table(tmp_path, expire_after_steps=16) as t:
        t.lookup(_ids(1), True)
        t.lookup(_ids(100), True)      # ``_ids(1)`` on disk, step 1
        for _ in range(3, 24):
            t.lookup(_ids(100), True)  # in RAM, in use
        ram, disk = _where(t, _ids(1))
        assert not (ram | disk).any() and t.stats()["expired"] == 16
        assert _where(t, _ids(100))[0].all()


def test_spill_expired_moves_rows_to_disk_and_the_disk_ttl_deletes_them(tmp_path) -> None:
    spill = {"spill_expired": True, "expire_after_steps": 20}
    with _table(tmp_path, capacity=64, tier=spill, expire_after_steps=8) as t, \
            _table(tmp_path, capacity=64) as ram_only:
        old = _ids(1)
        for table in (t, ram_only):
            table.lookup(old, True)
            table.update(old, np.ones((16, DIM), np.float32))
            for _ in range(12):
                table.lookup(_ids(100), True)
        ram, disk = _where(t, old)
        assert not ram.any() and disk.all()  # expired from RAM, kept on disk
        assert t.stats()["expired"] == 0 and t.disk_stats()["spilled"] == 16
        # Brought back as they were: the same weights as a table that never expired them.
        assert t.lookup(old, False).tobytes() == ram_only.lookup(old, False).tobytes()
        for _ in range(12):            # they expire in RAM again, then age on disk
            t.lookup(_ids(100), True)
        assert _where(t, old)[1].all()
        for _ in range(20):
            t.lookup(_ids(100), True)
        ram, disk = _where(t, old)
        assert not (ram | disk).any()  # past the disk's TTL: gone, counted
        assert t.stats()["expired"] == t.disk_stats()["disk_expired"] == 16


def test_stamps_move_with_rows_that_compaction_relocates(tmp_path) -> None:
    tier = DiskTier(str(tmp_path), capacity_rows=1_000, dim=DIM, weight_dtype=np.float32,
                    state_width=1, stamped=True)
    try:
        rng = np.random.default_rng(0)
        universe = np.arange(1, 1_000, dtype=np.uint64)
        stamp_of: dict[int, int] = {}
        for batch in range(41):        # a nearly full log: opened segments hold live rows
            ids = universe if batch == 0 else rng.choice(universe, 60, replace=False)
            n = ids.shape[0]
            gone = tier.write(ids, np.zeros((n, DIM), np.float32),
                              np.zeros((n, 1), np.float32), np.full(n, batch, np.int64))
            assert gone.shape[0] == 0
            stamp_of.update(dict.fromkeys(ids.tolist(), batch))
        assert tier.num_relocated > 0
        stored = np.array(sorted(stamp_of), np.uint64)
        assert tier.holds(stored).all() and tier.num_rows == stored.shape[0]
        want = np.array([stamp_of[i] for i in stored.tolist()])
        found, _, _, stamps = tier.peek_stamped(stored)
        assert found.all() and np.array_equal(stamps, want)
        gone = tier.expire(30)
        assert set(gone.tolist()) == {i for i, s in stamp_of.items() if s < 30}
        assert tier.num_expired == gone.shape[0] > 0 and tier.holds(stored[want >= 30]).all()
    finally:
        tier.close()


def test_disk_ttl_config_is_strict(tmp_path) -> None:
    def tier(**keys):
        return global_config_from_dict({"embedding_parameter_server_config": {
            "disk_tier": keys}}).embedding_parameter_server_config.disk_tier

    got = tier(path=str(tmp_path), capacity_rows=10, expire_after_steps=5,
               expire_after_seconds=60.0, spill_expired=True)
    assert (got.expire_after_steps, got.expire_after_seconds, got.spill_expired) == (
        5, 60.0, True)
    with pytest.raises(ConfigError, match="expire_after_steps"):
        tier(path=str(tmp_path), capacity_rows=10, expire_after_steps=0)
    with pytest.raises(ConfigError, match="expire_after_seconds"):
        tier(path=str(tmp_path), capacity_rows=10, expire_after_seconds=-1.0)
    with pytest.raises(ConfigError, match="spill_expired: expected bool"):
        tier(path=str(tmp_path), capacity_rows=10, spill_expired="yes")
    with pytest.raises(ConfigError, match="expire_after_steps: set, but path is not"):
        tier(expire_after_steps=5)
    with pytest.raises(ConfigError, match="did you mean 'expire_after_steps'"):
        tier(path=str(tmp_path), capacity_rows=10, expire_after_step=5)


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20) as answer:
        text = answer.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name.startswith(("persia_ps_disk", "persia_ps_ram"))}


def test_metrics_endpoint_shows_disk_ttl_hit_ratio_and_amplification(tmp_path) -> None:
    config = GlobalConfig(embedding_parameter_server_config=ParameterServerConfig(
        capacity=64, disk_tier=DiskTierConfig(path=str(tmp_path), capacity_rows=1_000,
                                              expire_after_steps=20)))
    ps = ParameterServer(config, EmbeddingTablesConfig(slots_config={"user": SlotConfig(dim=4)}))
    ps.configure(optimizer={"type": "sgd", "lr": 1.0})
    server = serve_metrics(ParameterServerMetrics(ps).registry, 0, "127.0.0.1", "ps")
    try:
        ids = np.arange(1, 321, dtype=np.uint64)
        for part in np.split(ids, 5):  # 320 rows through 64 in RAM: 256 spill
            ps.lookup([("user", part)], training=True)
        ps.lookup([("user", np.concatenate([ids[:64], ids[:64]]))], training=False)
        back = _scrape(server.port)
        # 128 ids asked: 64 answered from disk (each twice), none from RAM.
        assert back["persia_ps_ram_hit_ratio"] == 0.0
        assert back["persia_ps_disk_rows_read_total"] == 64
        amplification = back["persia_ps_disk_read_amplification"]
        record = 8 + 4 * 4  # id and dim 4 float32 weights; SGD keeps no state
        assert amplification == back["persia_ps_disk_reads_total"] * 512 / (64 * record)
        assert 1.0 <= amplification <= 512 / record + 1
        assert back["persia_ps_disk_expirations_total"] == 0
        for _ in range(30):         # the rows left on disk age past the disk's TTL
            ps.lookup([("user", ids[:64])], training=True)
        aged = _scrape(server.port)
        assert aged["persia_ps_disk_expirations_total"] == back["persia_ps_disk_rows"] > 0
        assert aged["persia_ps_disk_rows"] == 0
        assert ps.stats()["user"]["expired"] == aged["persia_ps_disk_expirations_total"]
        assert aged["persia_ps_ram_hit_ratio"] > 0.5
    finally:
        server.close()
        ps.close()


def test_disk_ttl_in_seconds_with_an_injected_clock(tmp_path) -> None:
    now = [100.0]
    with _table(tmp_path, tier={"expire_after_seconds": 10.0}, clock=lambda: now[0]) as t:
        old, new = _ids(1), _ids(100)
        t.lookup(old, True)
        now[0] = 105.0
        t.lookup(new, True)            # ``old`` spills, last used at 100
        t.lookup(_ids(200), True)      # ``new`` spills, last used at 105
        assert _where(t, old)[1].all() and _where(t, new)[1].all()
        now[0] = 110.5
        t.lookup(_ids(200), True)      # 10.5 s after ``old``'s last use: gone from disk
        assert not _where(t, old)[1].any() and _where(t, new)[1].all()
        now[0] = 121.0  # stamps may be a lookup late (never early): 10 s past it
        t.lookup(_ids(200), True)
        assert not _where(t, new)[1].any()
        assert t.stats()["expired"] == t.disk_stats()["disk_expired"] == 32
        assert _where(t, _ids(200))[0].all()  # in RAM, in use: the disk's TTL leaves it

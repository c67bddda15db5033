"""Checkpoint files written and read at the disk's speed (servers/array_files.py,
servers/table_files.py): tables of several chunks round trip and re-shard exactly,
``numpy.load`` still reads every file, and a damaged or cut file is refused by name
without changing the server."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from persia_py.checkpoint import layout as fmt
from persia_py.config import EmbeddingTablesConfig, GlobalConfig, ParameterServerConfig, SlotConfig
from persia_py.ids.routing import replica_of
from persia_py.ops import safe_files
from persia_py.servers.array_files import HEADER_BYTES, chunk_rows
from persia_py.servers.checkpoint import dump_replica, load_replica
from persia_py.servers.parameter_server import ParameterServer

DIM = 8
ROWS = 5 * chunk_rows(DIM * 4) // 2  # rows per replica: two and a half chunks


def _replicas(n: int, shards: int) -> list[ParameterServer]:
    cfg = GlobalConfig(embedding_parameter_server_config=ParameterServerConfig(
        num_hashmap_internal_shards=shards, capacity=4 * ROWS))
    embedding = EmbeddingTablesConfig(slots_config={"item": SlotConfig(dim=DIM)})
    replicas = [ParameterServer(cfg, embedding, replica_index=i, replica_size=n)
                for i in range(n)]
    for ps in replicas:
        ps.configure(optimizer={"type": "adagrad", "lr": 0.1}, seed=7)
    return replicas


def _fill(replicas: list[ParameterServer], rng: np.random.Generator) -> None:
    ids = rng.choice(2**62, size=ROWS * len(replicas), replace=False).astype(np.uint64)
    owner = replica_of(ids, len(replicas))
    for r, ps in enumerate(replicas):
        mine = ids[owner == r]
        ps.lookup([("item", mine)], training=True)
        grads = rng.normal(size=(mine.size, DIM)).astype(np.float32)
        ps.update([("item", mine, grads)])


def _dump(replicas: list[ParameterServer], root: Path) -> Path:
    tmp = fmt.new_tmp_dir(root)
    for ps in replicas:
        dump_replica(ps, tmp)
    return fmt.commit(tmp, {"num_ps_replicas": len(replicas), "rank_steps": [1]}, step=1)


def _rows(replicas: list[ParameterServer]) -> dict[str, np.ndarray]:
    parts = [ps.state_dict().tables["item"] for ps in replicas]
    ids = np.concatenate([p["ids"] for p in parts])
    order = np.argsort(ids)
    return {k: np.concatenate([p[k] for p in parts])[order]
            for k in ("ids", "weights", "state", "last_access")}


def test_tables_of_several_chunks_round_trip_and_reshard(tmp_path) -> None:
    before = _replicas(2, shards=3)
    _fill(before, np.random.default_rng(0))
    folder = _dump(before, tmp_path)
    description = json.loads((folder / "ps-0.json").read_text())["tables"]["item"]
    assert description["num_rows"] > 2 * description["chunk_rows"]
    weights = folder / description["files"]["weights"]
    # One page of header, so that every chunk is aligned; numpy reads it as its own.
    assert weights.read_bytes()[8:10] == (HEADER_BYTES - 10).to_bytes(2, "little")
    loaded = np.load(weights)
    assert loaded.shape == (description["num_rows"], DIM)
    ids = np.load(folder / description["files"]["ids"])
    rows = _rows(before)
    assert np.array_equal(loaded, rows["weights"][np.searchsorted(rows["ids"], ids)])
    for new in (1, 3):
        after = _replicas(new, shards=2)
        for ps in after:
            load_replica(ps, tmp_path)
        got = _rows(after)
        for key in ("ids", "weights", "state", "last_access"):
            assert np.array_equal(rows[key], got[key]), (new, key)


@pytest.mark.parametrize("damage", ["flip", "cut"])
def test_a_damaged_file_is_refused_by_name_and_changes_nothing(tmp_path, damage) -> None:
    before = _replicas(1, shards=2)
    _fill(before, np.random.default_rng(1))
    folder = _dump(before, tmp_path)
    description = json.loads((folder / "ps-0.json").read_text())["tables"]["item"]
    name = description["files"]["state"]
    path = folder / name
    size = path.stat().st_size
    if damage == "flip":  # one bit, deep in the second chunk
        with open(path, "r+b") as f:
            at = HEADER_BYTES + description["chunk_rows"] * 4 * DIM + 12345
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0x10]))
    else:
        os.truncate(path, size - 4)
    target = _replicas(1, shards=2)
    _fill(target, np.random.default_rng(2))
    kept = _rows(target)
    with pytest.raises(safe_files.CheckpointError, match=name) as info:
        load_replica(target[0], tmp_path)
    assert ("checksum" if damage == "flip" else "truncated") in str(info.value)
    got = _rows(target)
    for key in kept:
        assert np.array_equal(kept[key], got[key]), key


def test_rows_on_disk_stream_out_and_back_into_a_tiered_server(tmp_path) -> None:
    """A server with most rows on its disk tier dumps them (read sequentially from the
    tier) and loads into a fresh tiered server: RAM's share in RAM, the rest appended to
    its tier; every row bit-identical, and training goes on (spills after the load)."""
    from persia_py.config import DiskTierConfig

    rows, ram = 40_000, 4_000
    (tmp_path / "tier").mkdir()

    def server() -> ParameterServer:
        cfg = GlobalConfig(embedding_parameter_server_config=ParameterServerConfig(
            num_hashmap_internal_shards=2, capacity=ram,
            disk_tier=DiskTierConfig(path=str(tmp_path / "tier"), capacity_rows=2 * rows)))
        embedding = EmbeddingTablesConfig(slots_config={"item": SlotConfig(dim=DIM)},
                                          row_dtype="float16")
        ps = ParameterServer(cfg, embedding)
        ps.configure(optimizer={"type": "adagrad", "lr": 0.1}, seed=7)
        return ps

    before = server()
    rng = np.random.default_rng(3)
    ids = rng.choice(2**62, size=rows, replace=False).astype(np.uint64)
    for part in np.array_split(ids, 40):
        before.lookup([("item", part)], training=True)
        before.update([("item", part, rng.normal(size=(part.size, DIM)).astype(np.float32))])
    assert before.disk_stats()["item"]["disk_rows"] > rows // 2
    want = _rows([before])
    _dump([before], tmp_path / "ckpt")
    after = server()
    load_replica(after, tmp_path / "ckpt")
    assert after.disk_stats()["item"]["disk_rows"] == rows - after.stats()["item"]["entries"]
    got = _rows([after])
    for key in ("ids", "weights", "state"):
        assert np.array_equal(want[key], got[key]), key
    new = rng.choice(2**62, size=3 * ram, replace=False).astype(np.uint64) | np.uint64(1)
    for part in np.array_split(new, 12):  # spills past the appended rows
        after.lookup([("item", part)], training=True)
    assert after.disk_stats()["item"]["disk_evicted"] == 0  # the disk kept every row
    back = after.lookup([("item", ids[:500])], training=False)[0]
    assert np.array_equal(back, before.lookup([("item", ids[:500])], training=False)[0])


def test_checkpoints_written_before_sums_still_load(tmp_path) -> None:
    """Files as ``numpy.save`` wrote them (a 64- or 128-byte header: read through the page
    cache) and a description without ``sums`` / ``chunk_rows`` load as they always did."""
    before = _replicas(1, shards=2)
    _fill(before, np.random.default_rng(4))
    folder = _dump(before, tmp_path)
    entry = json.loads((folder / "ps-0.json").read_text())
    table = entry["tables"]["item"]
    for name in table["files"].values():
        array = np.load(folder / name)
        (folder / name).unlink()
        np.save(folder / name, array)
        assert (folder / name).read_bytes()[8:10] != (HEADER_BYTES - 10).to_bytes(2, "little")
    del table["sums"], table["chunk_rows"]
    (folder / "ps-0.json").write_text(json.dumps(entry))
    after = _replicas(1, shards=3)
    load_replica(after[0], tmp_path)
    want, got = _rows(before), _rows(after)
    for key in want:
        assert np.array_equal(want[key], got[key]), key

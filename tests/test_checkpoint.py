"""Checkpoints: crash-safe writes, N -> M re-sharding with optimizer state, dense state
round trips (a job killed and resumed, by hand or by itself: tests/test_chaos.py)."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from child_processes import RoleProcess

from persia_py.checkpoint import layout as fmt
from persia_py.config import EmbeddingTablesConfig, GlobalConfig, SlotConfig
from persia_py.ids.routing import replica_of
from persia_py.ops import safe_files
from persia_py.servers.checkpoint import dump_replica, load_replica
from persia_py.servers.parameter_server import ParameterServer

EMBEDDING = EmbeddingTablesConfig(slots_config={"user": SlotConfig(dim=4), "item": SlotConfig(dim=8)})
ADAGRAD = {"type": "adagrad", "lr": 0.1}


def _replicas(n: int, shards: int = 1, row_dtype: str = "float32") -> list[ParameterServer]:
    from persia_py.config import ParameterServerConfig

    cfg = GlobalConfig(embedding_parameter_server_config=ParameterServerConfig(
        num_hashmap_internal_shards=shards))
    embedding = EmbeddingTablesConfig(slots_config=EMBEDDING.slots_config, row_dtype=row_dtype)
    return [ParameterServer(cfg, embedding, replica_index=i, replica_size=n) for i in range(n)]


def _train(replicas: list[ParameterServer], rng: np.random.Generator, steps: int) -> None:
    n = len(replicas)
    for ps in replicas:
        ps.configure(optimizer=ADAGRAD, seed=7)
    for _ in range(steps):
        for slot, dim in (("user", 4), ("item", 8)):
            ids = np.unique(rng.integers(0, 5000, 400).astype(np.uint64))
            grads = rng.normal(size=(ids.size, dim)).astype(np.float32)
            owner = replica_of(ids, n)
            for r, ps in enumerate(replicas):
                ps.lookup([(slot, ids[owner == r])], training=True)
                ps.update([(slot, ids[owner == r], grads[owner == r])])


def _dump(replicas: list[ParameterServer], root: Path, step: int) -> Path:
    tmp = fmt.new_tmp_dir(root)
    for ps in replicas:
        dump_replica(ps, tmp)
    return fmt.commit(tmp, {"num_ps_replicas": len(replicas), "rank_steps": [step]}, step=step)


def _rows(replicas: list[ParameterServer], table: str) -> dict[str, np.ndarray]:
    parts = [ps.state_dict().tables[table] for ps in replicas]
    ids = np.concatenate([p["ids"] for p in parts])
    order = np.argsort(ids)
    return {k: np.concatenate([p[k] for p in parts])[order]
            for k in ("ids", "weights", "state")}


@pytest.mark.parametrize("old,new", [(2, 3), (3, 1)])
def test_resharding_keeps_every_row_and_its_optimizer_state(tmp_path, old, new) -> None:
    before = _replicas(old, shards=2)
    _train(before, np.random.default_rng(0), steps=5)
    folder = _dump(before, tmp_path, step=5)
    after = _replicas(new, shards=3)
    for ps in after:
        load_replica(ps, tmp_path)
    for table in ("user", "item"):
        want, got = _rows(before, table), _rows(after, table)
        assert want["ids"].size > 1000
        for key in want:
            assert np.array_equal(want[key], got[key]), (table, key)
        for r, ps in enumerate(after):  # each row went to the replica that owns it
            ids = ps.state_dict().tables[table]["ids"]
            assert (replica_of(ids, new) == r).all()
    # Training continues identically on the loaded copy.
    rng_a, rng_b = np.random.default_rng(1), np.random.default_rng(1)
    _train(before, rng_a, steps=2)
    _train(after, rng_b, steps=2)
    for table in ("user", "item"):
        assert all(np.array_equal(a, b) for a, b in
                   zip(_rows(before, table).values(), _rows(after, table).values()))
    assert folder.parent == tmp_path


@pytest.mark.parametrize("row_dtype", ["float16", "bfloat16"])
def test_half_rows_reshard_exactly_on_half_the_disk(tmp_path, row_dtype) -> None:
    runs = {}
    for kind in ("float32", row_dtype):
        replicas = _replicas(2, row_dtype=kind)
        _train(replicas, np.random.default_rng(0), steps=3)
        folder = _dump(replicas, tmp_path / kind, step=3)
        runs[kind] = replicas, sum(p.stat().st_size for p in folder.glob("*-weights.npy"))
    before, half_bytes = runs[row_dtype]
    assert half_bytes < 0.52 * runs["float32"][1]
    after = _replicas(3, row_dtype=row_dtype)
    for ps in after:
        load_replica(ps, tmp_path / row_dtype)
    for table in ("user", "item"):
        want, got = _rows(before, table), _rows(after, table)
        assert want["weights"].dtype == np.dtype(np.float16 if row_dtype == "float16"
                                                 else np.uint16)
        for key in want:
            assert np.array_equal(want[key], got[key]), (table, key)


@pytest.mark.parametrize("row_dtype", ["float16", "bfloat16"])
def test_float32_checkpoints_load_into_half_tables_and_back(tmp_path, caplog,
                                                              row_dtype) -> None:
    from persia_py.servers.row_types import to_float32

    full = _replicas(1)
    _train(full, np.random.default_rng(0), steps=3)
    _dump(full, tmp_path / "full", step=3)
    half = _replicas(1, row_dtype=row_dtype)
    with caplog.at_level("INFO"):
        load_replica(half[0], tmp_path / "full")
    assert f"stored as float32 were converted once to the table's {row_dtype}" in caplog.text
    unit = 2.0**-11 if row_dtype == "float16" else 2.0**-8  # half a unit, relative
    for table in ("user", "item"):
        want, got = _rows(full, table), _rows(half, table)
        assert np.array_equal(want["state"], got["state"])  # state stays float32
        np.testing.assert_allclose(to_float32(got["weights"], row_dtype), want["weights"],
                                   rtol=unit, atol=1e-7)
    _dump(half, tmp_path / "half", step=4)
    back = _replicas(1)
    load_replica(back[0], tmp_path / "half")  # widening is exact
    for table in ("user", "item"):
        assert np.array_equal(_rows(back, table)["weights"],
                              to_float32(_rows(half, table)["weights"], row_dtype))


def test_float16_tables_refuse_weights_past_their_range(tmp_path) -> None:
    full = _replicas(1)
    full[0].configure(optimizer=ADAGRAD, seed=7)
    ids = np.arange(1, 11, dtype=np.uint64)
    state = np.ones((10, 4), np.float32)
    full[0].apply_rows({"user": {"ids": ids, "weights": np.full((10, 4), 7e4, np.float32),
                                 "state": state, "last_access": np.zeros(10, np.int64),
                                 "clock": 0}})
    _dump(full, tmp_path, step=1)
    half = _replicas(1, row_dtype="float16")[0]
    with pytest.raises(safe_files.CheckpointError, match="past float16's 65504"):
        load_replica(half, tmp_path)
    assert not half.configured  # nothing changed


def test_load_refuses_incomplete_checkpoints_and_other_settings(tmp_path) -> None:
    ps = _replicas(1)[0]
    _train([ps], np.random.default_rng(0), steps=1)
    tmp = fmt.new_tmp_dir(tmp_path)
    dump_replica(ps, tmp)  # no manifest: an interrupted write
    with pytest.raises(safe_files.CheckpointError, match="not a complete checkpoint"):
        load_replica(_replicas(1)[0], tmp)
    _dump([ps], tmp_path, step=1)
    other = _replicas(1)[0]
    other.configure(optimizer={"type": "sgd", "lr": 0.1})
    from persia_py.wire.rpc import FailedPrecondition
    with pytest.raises(FailedPrecondition, match="checkpoint"):
        load_replica(other, tmp_path)


def test_dense_model_and_optimizer_round_trip_without_pickle(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    for _ in range(3):
        model(torch.randn(8, 5)).sum().backward()
        opt.step()
    fmt.save_tensors(tmp_path, "m", model.state_dict())
    fmt.save_optimizer(tmp_path, "o", opt)
    model2 = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3))
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.5)
    model2.load_state_dict(fmt.load_tensors(tmp_path, "m"))
    fmt.load_optimizer(tmp_path, "o", opt2)
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k
    assert opt2.param_groups[0]["betas"] == (0.8, 0.9) and opt2.param_groups[0]["lr"] == 0.01
    for s1, s2 in zip(opt.state.values(), opt2.state.values()):
        assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert all(p.suffix in (".npy", ".json") for p in tmp_path.iterdir())


WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from persia_py.checkpoint import layout as fmt
    from persia_py.ops import safe_files
    root = sys.argv[1]
    ids = np.arange(1, 400_001, dtype=np.uint64)
    for step in range(1, 1000):
        tmp = fmt.new_tmp_dir(root)
        # Every array of checkpoint `step` holds the value `step`.
        safe_files.save_array(tmp / "ids.npy", ids)
        for name in ("weights", "state"):
            safe_files.save_array(tmp / f"{name}.npy", np.full((ids.size, 32), step, np.float32))
        fmt.commit(tmp, {"rows": int(ids.size)}, step=step)
        print("committed", step, flush=True)
""")


@pytest.mark.processes
def test_sigkill_during_a_checkpoint_write_leaves_the_previous_one_intact(tmp_path) -> None:
    root = tmp_path / "ckpt"
    writer = RoleProcess([sys.executable, "-c", WRITER, str(root)])
    try:
        writer.wait_for_line(r"committed 2", timeout=60)
        deadline = time.monotonic() + 30
        while not any(p.name.startswith("tmp-") and p.is_dir() for p in root.iterdir()):
            assert time.monotonic() < deadline, "no checkpoint write in progress seen"
        os.kill(writer.process.pid, signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        writer.stop()
    assert any(p.name.startswith("tmp-") for p in root.iterdir())  # killed mid-write
    folder = fmt.resolve(root)
    manifest = fmt.read_manifest(root)
    step = manifest["step"]
    assert step >= 2 and manifest["rows"] == 400_000
    assert np.array_equal(safe_files.load_array(folder / "ids.npy"), np.arange(1, 400_001))
    for name in ("weights", "state"):
        assert (safe_files.load_array(folder / f"{name}.npy") == step).all()

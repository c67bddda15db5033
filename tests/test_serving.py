"""Serving: a parameter server in inference mode is read-only, and ``persia-launcher
serve`` answers, for the same rows, exactly what the training job's ``eval_ctx`` did."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import EXAMPLE, ROOT, RoleProcess, launcher_command

from persia_py.config import CommonConfig, EmbeddingConfig, GlobalConfig, SlotConfig
from persia_py.rpc import FailedPrecondition
from persia_py.servers.parameter_server import ParameterServer

sys.path.insert(0, str(EXAMPLE))
from data_generator import SLOT_NAMES, make_batches  # noqa: E402

JOB = ROOT / "tests" / "serving_job"


def test_an_inference_replica_never_inserts_and_refuses_updates() -> None:
    ps = ParameterServer(GlobalConfig(), EmbeddingConfig(slots_config={
        "user": SlotConfig(dim=4, expire_after_steps=1)}), inference=True)
    ps.configure(optimizer={"type": "sgd", "lr": 0.1})
    ids = np.arange(1, 100, dtype=np.uint64)
    ps._tables["user"].import_rows(ids[:50], np.ones((50, 4), np.float32),
                                   np.zeros((50, 0), np.float32), np.zeros(50, np.int64), 0)
    (rows,) = ps.lookup([("user", ids)], training=False)
    assert (rows[:50] == 1).all() and (rows[50:] == 0).all()
    for _ in range(3):  # no expiry on a serving replica
        ps.lookup([("user", ids)], training=False)
    assert ps.stats()["user"]["entries"] == 50
    with pytest.raises(FailedPrecondition, match="inference mode"):
        ps.lookup([("user", ids)], training=True)
    with pytest.raises(FailedPrecondition, match="inference mode"):
        ps.update([("user", ids, np.ones((ids.size, 4), np.float32))])
    assert ps.stats()["user"]["entries"] == 50


def _ps_entries(addresses: list[str]) -> int:
    from persia_py.workers.ps_client import PSClient

    total = 0
    for address in addresses:
        client = PSClient(address, CommonConfig())
        try:
            total += sum(t.entries for t in client.stats().tables)
        finally:
            client.close()
    return total


def test_served_predictions_equal_the_training_jobs_evaluation(tmp_path: Path) -> None:
    ckpt, predictions = tmp_path / "ckpt", tmp_path / "eval.npy"
    num_test, batch_size = 1000, 256
    job = RoleProcess(launcher_command(
        "local", "--nn-worker", str(JOB / "train_and_eval.py"),
        "--data-loader", str(EXAMPLE / "data_loader.py"),
        "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
        "--global-config", str(EXAMPLE / "global_config.yml"), "--num-ps", "2",
        "--no-metrics", "--run-dir", str(tmp_path / "run"),
        "--data-loader-args", "--train-samples 2560",
        "--nn-worker-args", f"--checkpoint {ckpt} --predictions {predictions} "
                            f"--test-samples {num_test} --test-batch-size {batch_size}"))
    try:
        assert job.wait(timeout=240) == 0, job.output()
    finally:
        job.stop()
    want = np.load(predictions)
    assert want.shape == (num_test, 1)

    serve = RoleProcess(launcher_command(
        "serve", "--checkpoint", str(ckpt), "--num-ps", "3",
        "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
        "--global-config", str(EXAMPLE / "global_config.yml"),
        "--model", f"{EXAMPLE / 'model.py'}:DLRM"))
    try:
        ps_addrs = serve.wait_for_line(r"serve: parameter servers (\S+)", timeout=120)
        port = int(serve.wait_for_line(r"serve ready on port (\d+)", timeout=60).group(1))
        ps_addrs = ps_addrs.group(1).split(",")
        entries = _ps_entries(ps_addrs)
        assert entries > 1000
        from persia_py.serving import ServingClient

        client = ServingClient(f"127.0.0.1:{port}")
        try:
            import grpc

            with pytest.raises(grpc.RpcError) as refused:  # a slot missing: the caller's error
                client.predict([(SLOT_NAMES[0], np.ones(2, np.uint64), np.ones(2, np.int32))],
                               [np.zeros((2, 13), np.float32)])
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            got = []
            for dense, ids, _ in make_batches("test", num_test, batch_size):
                features = [(n, i, np.ones(i.size, np.int32)) for n, i in zip(SLOT_NAMES, ids)]
                (output,) = client.predict(features, [dense])
                got.append(output)
        finally:
            client.close()
        got = np.concatenate(got)
        assert got.shape == want.shape
        # Same rows (loaded into 3 replicas from a checkpoint of 2), same weights, same
        # code path (InferCtx and eval_ctx share EmbeddingCtx.forward): bit-identical.
        np.testing.assert_array_equal(got, want)
        assert _ps_entries(ps_addrs) == entries  # serving inserted nothing
    finally:
        serve.stop()
    assert "Traceback" not in serve.output(), serve.output()


# -- incremental exports -------------------------------------------------------------------


def _rows_of(replicas: list[ParameterServer], table: str) -> dict[str, np.ndarray]:
    parts = [ps._tables[table].export_rows() for ps in replicas]
    ids = np.concatenate([p["ids"] for p in parts])
    order = np.argsort(ids)
    return {k: np.concatenate([p[k] for p in parts])[order] for k in ("ids", "weights", "state")}


def test_a_serving_replica_following_increments_converges_to_the_training_rows(
        tmp_path: Path) -> None:
    from persia_py import checkpoint_format as fmt
    from persia_py.routing import replica_of
    from persia_py.servers.checkpoint import dump_replica, load_replica
    from persia_py.servers.increments import (
        IncrementalExporter,
        IncrementFollower,
        base_increment_seqs,
        newest_increments,
    )

    embedding = EmbeddingConfig(slots_config={"user": SlotConfig(dim=4),
                                              "item": SlotConfig(dim=8)})
    training = [ParameterServer(GlobalConfig(), embedding, replica_index=i, replica_size=2)
                for i in range(2)]
    for ps in training:
        ps.configure(optimizer={"type": "adagrad", "lr": 0.1}, seed=3)
    inc_dir, root = tmp_path / "increments", tmp_path / "ckpt"
    # By count, checked by the exporter thread; export_now below forces the last one.
    exporters = [IncrementalExporter(ps, inc_dir, every_updates=3).start() for ps in training]
    rng = np.random.default_rng(0)

    def train(steps: int) -> None:
        for _ in range(steps):
            for slot, dim in (("user", 4), ("item", 8)):
                ids = np.unique(rng.integers(1, 3000, 300).astype(np.uint64))
                owner = replica_of(ids, 2)
                grads = rng.normal(size=(ids.size, dim)).astype(np.float32)
                for r, ps in enumerate(training):
                    ps.lookup([(slot, ids[owner == r])], training=True)
                    ps.update([(slot, ids[owner == r], grads[owner == r])])

    try:
        train(4)
        for e in exporters:
            e.export_now()
        tmp = fmt.new_tmp_dir(root)
        for ps in training:
            dump_replica(ps, tmp)
        fmt.commit(tmp, {"num_ps_replicas": 2, "rank_steps": [4]}, step=4)
        train(10)  # ids never seen before the checkpoint come in too
        for e in exporters:
            e.export_now()
    finally:
        for e in exporters:
            e.close()
    serving = ParameterServer(GlobalConfig(), embedding, inference=True)  # 2 replicas -> 1
    load_replica(serving, root)
    base = base_increment_seqs(root)
    assert all(seq >= 1 for seq in base.values())
    follower = IncrementFollower(serving, inc_dir, after=base, poll_sec=0.05).start()
    try:
        newest = newest_increments(inc_dir)
        assert all(newest[r] > base[r] for r in range(2))
        for r, seq in newest.items():
            assert follower.wait_applied(r, seq, timeout=30), follower.applied
    finally:
        follower.close()
    for table in ("user", "item"):
        want, got = _rows_of(training, table), _rows_of([serving], table)
        for key in want:
            assert np.array_equal(want[key], got[key]), (table, key)

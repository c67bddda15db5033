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

"""Serving: a parameter server in inference mode is read-only, and ``persia-launcher
serve`` answers, for the same rows, exactly what the training job's ``eval_ctx`` did."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from checkout import EXAMPLE, ROOT
from child_processes import RoleProcess, launcher_command

from persia_py.config import CommonConfig, EmbeddingTablesConfig, GlobalConfig, SlotConfig
from persia_py.servers.parameter_server import ParameterServer
from persia_py.wire.rpc import FailedPrecondition

sys.path.insert(0, str(EXAMPLE))
from data_generator import SLOT_NAMES, make_batches  # noqa: E402

JOB = ROOT / "tests" / "serving_job"


def test_an_inference_replica_never_inserts_and_refuses_updates() -> None:
    ps = ParameterServer(GlobalConfig(), EmbeddingTablesConfig(slots_config={
        "user": SlotConfig(dim=4, expire_after_steps=1)}), inference=True)
    ps.configure(optimizer={"type": "sgd", "lr": 0.1})
    ids = np.arange(1, 100, dtype=np.uint64)
    ps.apply_rows({"user": {"ids": ids[:50], "weights": np.ones((50, 4), np.float32),
                            "state": np.zeros((50, 0), np.float32),
                            "last_access": np.zeros(50, np.int64), "clock": 0}})
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


@pytest.mark.processes
def test_served_predictions_equal_the_training_jobs_evaluation(tmp_path: Path) -> None:
    ckpt, predictions = tmp_path / "ckpt", tmp_path / "eval.npy"
    num_test, batch_size = 1000, 256
    global_config = tmp_path / "global_config.yml"  # the example's, checkpoints in tmp_path
    global_config.write_text((EXAMPLE / "global_config.yml").read_text()
                             + f"checkpoint_config:\n  root: {tmp_path}\n")
    job = RoleProcess(launcher_command(
        "local", "--nn-worker", str(JOB / "train_and_eval.py"),
        "--data-loader", str(EXAMPLE / "data_loader.py"),
        "--embedding-config", str(EXAMPLE / "embedding_config.yml"),
        "--global-config", str(global_config), "--num-ps", "2",
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
    parts = [ps.state_dict().tables[table] for ps in replicas]
    ids = np.concatenate([p["ids"] for p in parts])
    order = np.argsort(ids)
    return {k: np.concatenate([p[k] for p in parts])[order] for k in ("ids", "weights", "state")}


@pytest.mark.parametrize(("trained", "served"), [
    ("float32", "float32"), ("float16", "float16"), ("bfloat16", "float32")])
def test_a_serving_replica_following_increments_converges_to_the_training_rows(
        tmp_path: Path, trained: str, served: str) -> None:
    """Rows travel in their storage type; a replica that stores another one (here
    float32 serving bfloat16 training rows) converts them as they arrive."""
    from persia_py.checkpoint import layout as fmt
    from persia_py.ids.routing import replica_of
    from persia_py.servers.checkpoint import dump_replica, load_replica
    from persia_py.servers.increments import (
        IncrementalExporter,
        IncrementFollower,
        base_increment_seqs,
        newest_increments,
    )
    from persia_py.servers.row_types import to_float32

    slots = {"user": SlotConfig(dim=4), "item": SlotConfig(dim=8)}
    embedding = EmbeddingTablesConfig(slots_config=slots, row_dtype=trained)
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
    serving = ParameterServer(GlobalConfig(), EmbeddingTablesConfig(
        slots_config=slots, row_dtype=served), inference=True)  # 2 replicas -> 1
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
        want["weights"] = to_float32(want["weights"], trained)
        got["weights"] = to_float32(got["weights"], served)
        for key in want:
            assert np.array_equal(want[key], got[key]), (table, key)


@pytest.mark.processes
def test_failed_exports_and_applies_are_retried_and_lose_no_row(tmp_path: Path) -> None:
    import re
    import shutil
    import threading
    import urllib.request

    from child_processes import start_server

    from persia_py.servers.increments import IncrementFollower, newest_increments, write_increment
    from persia_py.workers.ps_client import PSClient, configure_request

    inc = tmp_path / "inc"
    (tmp_path / "e.yml").write_text("slots_config:\n  user:\n    dim: 4\n")
    (tmp_path / "g.yml").write_text(f"checkpoint_config:\n  root: {tmp_path}\n"
                                    f"  incremental_dir: {inc}\n  incremental_every_sec: 0.1\n")
    proc, port = start_server("embedding-parameter-server", "--metrics-port", "0",
                              "--embedding-config", str(tmp_path / "e.yml"),
                              "--global-config", str(tmp_path / "g.yml"))
    metrics_url = re.search(r"metrics on (http://\S+)", proc.output()).group(1)
    client = PSClient(f"127.0.0.1:{port}", CommonConfig(rpc_timeout_sec=30))
    optimizer = {"type": "adagrad", "lr": 0.1}
    ids = np.arange(1, 301, dtype=np.uint64)
    try:
        client.configure(configure_request(optimizer, init_lower=-0.1, init_upper=0.1,
                                           weight_bound=None, seed=1))

        def train(part: np.ndarray, sequence: int) -> None:
            client.lookup([("user", part)], training=True)
            client.update([("user", part, np.ones((part.size, 4), np.float32))],
                          worker_id="w-" + "0" * 32, sequence=sequence)

        train(ids[:100], 1)
        proc.wait_for_line(r"exported increment 1 ", timeout=60)
        # The folder is gone (a file in its place): exports fail, training goes on.
        inc.rename(tmp_path / "inc-away")
        inc.write_text("not a folder")
        train(ids[50:300], 2)
        proc.wait_for_line(r"incremental export of replica 0 .* failed", timeout=60)
        inc.unlink()
        (tmp_path / "inc-away").rename(inc)
        proc.wait_for_line(r"incremental export of replica 0 .* works again", timeout=60)
        want = client.lookup([("user", ids)], training=False)[0]
        with urllib.request.urlopen(metrics_url, timeout=10) as answer:
            scraped = answer.read().decode()
        failures = re.search(r'persia_ps_increment_failures_total\{kind="export"\} (\S+)',
                             scraped)
        assert failures and float(failures.group(1)) >= 1, scraped
    finally:
        client.close()
        proc.stop()
    assert proc.output().count("Traceback") == 0, proc.output()

    # A serving replica following the increments gets every row, those of the outage too;
    # an increment it cannot apply is retried, and serving goes on meanwhile.
    serving = ParameterServer(GlobalConfig(), EmbeddingTablesConfig(slots_config={
        "user": SlotConfig(dim=4)}), inference=True)
    serving.configure(optimizer=optimizer, init_lower=-0.1, init_upper=0.1, seed=1)
    newest = newest_increments(inc)[0]
    broken = inc / f"inc-0000-{newest + 1:012d}-00"
    broken.mkdir()
    (broken / "manifest.json").write_text("{not json")
    failed = threading.Event()
    follower = IncrementFollower(serving, inc, poll_sec=0.05, on_failure=failed.set).start()
    try:
        assert follower.wait_applied(0, newest, timeout=30), follower.applied
        np.testing.assert_array_equal(serving.lookup([("user", ids)], training=False)[0], want)
        assert failed.wait(timeout=30)
        assert follower.error is None and follower.outage.failing
        shutil.rmtree(broken)
        extra = np.array([1000], np.uint64)
        write_increment(inc, 0, 1, newest + 1, {"user": {
            "ids": extra, "weights": np.full((1, 4), 3, np.float32),
            "state": np.zeros((1, 4), np.float32), "last_access": np.ones(1, np.int64),
            "clock": 1}})
        assert follower.wait_applied(0, newest + 1, timeout=30), follower.applied
        assert (serving.lookup([("user", extra)], training=False)[0] == 3).all()
    finally:
        follower.close()

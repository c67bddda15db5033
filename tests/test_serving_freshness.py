"""Fresh serving: increments carry the rows the training side removed (expiry, eviction)
and a following replica removes them too; dense model versions are checked whole before
they are swapped in; and ``persia-launcher serve`` following a training job answers with
its newest dense model and rows, never a half-swapped model, forgets expired ids, exposes
its freshness and warns when it falls behind."""

from __future__ import annotations

import re
import shutil
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from checkout import ROOT
from child_processes import RoleProcess, launcher_command, start_server
from prometheus_client.parser import text_string_to_metric_families

from persia_py.checkpoint.dense_export import (
    KEEP_VERSIONS,
    DenseFollower,
    DenseModelSlot,
    dense_versions,
    read_dense_version,
    write_dense_version,
)
from persia_py.config import (
    CheckpointConfig,
    CommonConfig,
    EmbeddingTablesConfig,
    GlobalConfig,
    SlotConfig,
)
from persia_py.ops import safe_files
from persia_py.servers.parameter_server import ParameterServer

sys.path.insert(0, str(ROOT / "tests" / "serving_job"))
from freshness_model import Tower  # noqa: E402

MODEL_FILE = ROOT / "tests" / "serving_job" / "freshness_model.py"


def _rows(ps: ParameterServer, table: str) -> dict[str, np.ndarray]:
    rows = ps.state_dict().tables[table]
    order = np.argsort(rows["ids"])
    return {k: rows[k][order] for k in ("ids", "weights", "state")}


def test_a_following_replica_forgets_what_training_expired_or_evicted(tmp_path: Path) -> None:
    from persia_py.ids.routing import replica_of
    from persia_py.servers.increments import IncrementalExporter, IncrementFollower

    embedding = EmbeddingTablesConfig(slots_config={
        "user": SlotConfig(dim=4, expire_after_steps=4),  # unseen for 4 lookups: gone
        "item": SlotConfig(dim=4, capacity=64)})  # past 64 rows: the LRU ones go
    training = ParameterServer(GlobalConfig(), embedding)
    training.configure(optimizer={"type": "adagrad", "lr": 0.1}, seed=3)
    inc = tmp_path / "inc"
    exporter = IncrementalExporter(training, inc, every_updates=10**9)  # exports by hand
    serving = [ParameterServer(GlobalConfig(), embedding, inference=True, replica_index=i,
                               replica_size=2) for i in range(2)]  # 1 training replica -> 2
    for ps in serving:
        ps.configure(optimizer={"type": "adagrad", "lr": 0.1}, seed=3)
    rng = np.random.default_rng(0)

    def train(users: np.ndarray, items: np.ndarray) -> None:
        training.lookup([("user", users), ("item", items)], training=True)
        training.update([("user", users, rng.normal(size=(users.size, 4)).astype(np.float32)),
                         ("item", items, rng.normal(size=(items.size, 4)).astype(np.float32))])

    old_users, new_users = np.arange(1, 41, dtype=np.uint64), np.arange(100, 140, dtype=np.uint64)
    train(old_users, np.arange(1, 50, dtype=np.uint64))
    assert exporter.export_now() is not None
    for step in range(6):  # old users expire; 120 new items push the first ones out
        train(new_users, np.arange(100 + 20 * step, 120 + 20 * step, dtype=np.uint64))
    # This export fails (its folder is a file now): what it took, removed ids included,
    # stays pending and goes out with the next one.
    inc.rename(tmp_path / "away")
    inc.write_text("not a folder")
    with pytest.raises(safe_files.CheckpointError, match="is not a folder"):
        exporter.export_now()
    inc.unlink()
    (tmp_path / "away").rename(inc)
    train(old_users[:10], np.arange(1, 5, dtype=np.uint64))  # some come back: rows again
    train(new_users, np.arange(300, 305, dtype=np.uint64))
    assert exporter.export_now() is not None
    stats = training.stats()
    assert stats["user"]["expired"] >= 30 and stats["item"]["evicted"] >= 50, stats

    followers = [IncrementFollower(ps, inc, poll_sec=0.05) for ps in serving]
    for follower in followers:
        follower.apply_new()
        assert follower.applied == {0: 2} and follower.age_sec() is not None
    for table in ("user", "item"):
        want = _rows(training, table)
        parts = [_rows(ps, table) for ps in serving]
        for r, part in enumerate(parts):  # each serving replica holds exactly its share
            assert (replica_of(part["ids"], 2) == r).all()
        got = {k: np.concatenate([p[k] for p in parts]) for k in want}
        order = np.argsort(got["ids"])
        for key in want:
            np.testing.assert_array_equal(got[key][order], want[key], err_msg=f"{table} {key}")
    gone = old_users[10:]
    for r, ps in enumerate(serving):
        (rows,) = ps.lookup([("user", gone[replica_of(gone, 2) == r])], training=False)
        assert rows.shape[0] and not rows.any()  # forgotten: reads as an unknown id


def test_a_lookup_sees_an_increment_wholly_or_not_at_all() -> None:
    """An increment removes ids and stores rows in two passes; a lookup meanwhile would
    read removed ids as zeros. Here every increment removes all ids and stores them again
    with one value: each answer must hold one value, never zeros beside it."""
    embedding = EmbeddingTablesConfig(slots_config={"user": SlotConfig(dim=4)})
    ps = ParameterServer(GlobalConfig(), embedding, inference=True)
    ps.configure(optimizer={"type": "adagrad", "lr": 0.1}, seed=3)
    ids = np.arange(1, 5001, dtype=np.uint64)

    def rows(value: float) -> dict:
        return {"user": {"ids": ids, "weights": np.full((ids.size, 4), value, np.float32),
                         "state": np.zeros((ids.size, 4), np.float32),
                         "last_access": np.zeros(ids.size, np.int64), "clock": 0}}

    ps.apply_increment({}, rows(1.0))
    done, seen, mixed = threading.Event(), set(), []

    def read() -> None:
        while not done.is_set():
            (got,) = ps.lookup([("user", ids)], training=False)
            values = np.unique(got)
            seen.update(values.tolist())
            if values.size != 1:
                mixed.append(values)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    for version in range(2, 60):
        ps.apply_increment({"user": ids}, rows(float(version)))
    done.set()
    for t in readers:
        t.join(timeout=60)
    assert not mixed, f"answers mixing versions or removed rows: {mixed[:3]}"
    assert 0.0 not in seen and len(seen) > 1, seen  # the readers saw several versions


def test_a_dense_version_is_checked_whole_before_it_is_swapped_in(tmp_path: Path) -> None:
    torch.manual_seed(0)
    good = Tower()
    for seq in range(1, KEEP_VERSIONS + 3):
        write_dense_version(tmp_path, seq, good.state_dict(), step=seq * 10)
    assert [s for s, _ in dense_versions(tmp_path)] == list(range(3, KEEP_VERSIONS + 3))
    state, manifest = read_dense_version(dense_versions(tmp_path)[-1][1], Tower().state_dict())
    assert manifest["step"] == (KEEP_VERSIONS + 2) * 10
    assert all(torch.equal(state[k], v) for k, v in good.state_dict().items())

    bad = {"shape": {**good.state_dict(), "out.weight": torch.zeros(1, 9)},
           "NaN": {**good.state_dict(), "out.bias": torch.tensor([float("nan")])},
           "missing": {k: v for k, v in good.state_dict().items() if k != "out.bias"}}
    messages = {"shape": r"'out.weight': shape \(1, 9\), the model's is \(1, 8\)",
                "NaN": "'out.bias': NaN or infinite", "missing": r"missing \['out.bias'\]"}
    for what, tensors in bad.items():
        folder = write_dense_version(tmp_path / what, 1, tensors, step=1)
        with pytest.raises(safe_files.CheckpointError, match=messages[what]):
            read_dense_version(folder, Tower().state_dict())

    # A follower swaps in only a whole, checked, newer version; a bad one is retried and
    # the slot keeps answering with the model it has.
    served = Tower()
    slot = DenseModelSlot(served, created_unix=0.0)
    follower = DenseFollower(slot, tmp_path / "shape", Tower, poll_sec=0.05)
    follower.outage.attempt(follower.poll_once)
    assert follower.outage.failing and slot.current() == (served, 0)
    shutil.rmtree(tmp_path / "shape")
    write_dense_version(tmp_path / "shape", 2, good.state_dict(), step=2)
    assert follower.poll_once() and slot.current()[1] == 2
    model, _ = slot.current()
    assert model is not served and not model.training
    assert all(torch.equal(model.state_dict()[k], v) for k, v in good.state_dict().items())
    old = DenseModelSlot(served)  # newer than any version written before it: kept
    assert not DenseFollower(old, tmp_path / "shape", Tower).poll_once()


# -- a serving process following a training job ----------------------------------------------


def _batch(users: np.ndarray, items: np.ndarray, seed: int, requires_grad: bool = True):
    from persia_py.embedding.data import (
        IDTypeFeatureWithSingleID,
        Label,
        NonIDTypeFeature,
        PersiaBatch,
    )

    rng = np.random.default_rng(seed)
    n = users.size
    return PersiaBatch(
        [IDTypeFeatureWithSingleID("user", users), IDTypeFeatureWithSingleID("item", items)],
        non_id_type_features=[NonIDTypeFeature(rng.normal(size=(n, 2)).astype(np.float32))],
        labels=[Label(rng.integers(0, 2, (n, 1)).astype(np.float32))] if requires_grad else None,
        requires_grad=requires_grad)


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


class Prober(threading.Thread):
    """Asks ``serve`` for the same batch again and again while versions are swapped in."""

    def __init__(self, client, features, dense) -> None:
        super().__init__(daemon=True)
        self.client, self.features, self.dense = client, features, dense
        self.outputs: list[np.ndarray] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.outputs.append(self.client.predict(self.features, [self.dense])[0])
        except BaseException as exc:  # re-raised by the test
            self.error = exc


@pytest.mark.processes
def test_serve_follows_training_fresh_whole_and_forgetting(tmp_path: Path) -> None:
    from persia_py.ctx import TrainCtx, eval_ctx
    from persia_py.data import DataLoader, IterableDataset
    from persia_py.embedding.optim import Adagrad
    from persia_py.env import PersiaEnv
    from persia_py.serving import ServingClient
    from persia_py.workers.ps_client import PSClient

    inc, dense_dir, ckpt = tmp_path / "inc", tmp_path / "dense", tmp_path / "ckpt"
    embedding_yml, global_yml = tmp_path / "embedding.yml", tmp_path / "global.yml"
    embedding_yml.write_text("slots_config:\n  user:\n    dim: 4\n    expire_after_steps: 6\n"
                             "  item:\n    dim: 4\n")
    global_yml.write_text(f"checkpoint_config:\n  root: {tmp_path}\n  incremental_dir: {inc}\n"
                          "  incremental_every_sec: 0.5\n")
    config = ["--embedding-config", str(embedding_yml), "--global-config", str(global_yml)]
    ps, ps_port = start_server("embedding-parameter-server", *config)
    ew, ew_port = start_server("embedding-worker", *config, "--ps-addrs", f"127.0.0.1:{ps_port}")
    serve = None
    common = CommonConfig(rpc_timeout_sec=30, startup_timeout_sec=60)
    global_config = GlobalConfig(common_config=common, checkpoint_config=CheckpointConfig(
        root=str(tmp_path), dense_export_dir=str(dense_dir), dense_export_every_steps=3))
    env = PersiaEnv(embedding_worker_addrs=(f"127.0.0.1:{ew_port}",),
                    ps_addrs=(f"127.0.0.1:{ps_port}",))

    class Batches(IterableDataset):
        def __init__(self, batches) -> None:
            super().__init__(buffer_size=4)
            self.batches = batches

        def __iter__(self):
            return iter(self.batches)

    old_users, new_users = np.arange(1, 41, dtype=np.uint64), np.arange(100, 140, dtype=np.uint64)
    # The probe: users never trained (zeros everywhere) and items trained only before the
    # base checkpoint, so its answer moves with the dense model alone.
    probe_users = np.arange(10_000, 10_008, dtype=np.uint64)
    probe_items = np.arange(1, 9, dtype=np.uint64)
    torch.manual_seed(0)
    model = Tower()
    try:
        with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                      dense_optimizer=torch.optim.Adagrad(model.parameters(), lr=0.1),
                      global_config=global_config, env=env) as ctx:

            def train(batches, probe=None) -> list[np.ndarray]:
                """Train; the probe's answer after each step that exported a version."""
                versions = []
                for batch in DataLoader(Batches(batches), embedding_staleness=1):
                    output, labels = ctx.forward(batch)
                    ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
                    if probe is not None and ctx.checkpointer.steps % 3 == 0:
                        with eval_ctx(model) as evaluation:
                            versions.append(evaluation.forward(probe)[0].numpy())
                return versions

            train([_batch(old_users, np.arange(1, 41, dtype=np.uint64), s) for s in range(6)])
            probe_batch = _batch(probe_users, probe_items, 99, requires_grad=False)
            probe = ctx.prepare(probe_batch)
            with eval_ctx(model) as evaluation:
                versions = [evaluation.forward(probe)[0].numpy()]
            ctx.flush()
            ctx.dump_checkpoint(str(ckpt))

            serve = RoleProcess(launcher_command(
                "serve", "--checkpoint", str(ckpt), "--num-ps", "1", *config,
                "--model", f"{MODEL_FILE}:Tower", "--follow-increments", str(inc),
                "--follow-dense", str(dense_dir), "--metrics-port", "0"))
            serve_metrics = serve.wait_for_line(r"serve metrics on (http://\S+)", 120).group(1)
            ps_metrics = re.search(r"\[ps-0\] .* metrics on (http://\S+)", serve.output())
            serving_ps = serve.wait_for_line(r"serve: parameter servers (\S+)", 120).group(1)
            port = int(serve.wait_for_line(r"serve ready on port (\d+)", 60).group(1))
            client = ServingClient(f"127.0.0.1:{port}", common)
            features = [("user", probe_users, np.ones(8, np.int32)),
                        ("item", probe_items, np.ones(8, np.int32))]
            probe_dense = probe_batch.non_id_type_features[0].data
            prober = Prober(client, features, probe_dense)
            prober.start()
            try:
                # Old users go unseen for more than 6 lookups: they expire in training.
                versions += train([_batch(new_users, np.arange(41, 81, dtype=np.uint64), s)
                                   for s in range(6, 21)], probe)
                ctx.flush()
                assert ctx.dense_exporter.flush(60)
                newest = ctx.dense_exporter.seq
                # The newest dense model: each swap is logged; wait for the newest's.
                swapped = 0
                while swapped < newest:
                    swapped = int(serve.wait_for_line(r"dense model version (\d+) .*swapped in",
                                                      60).group(1))
                (answer,) = client.predict(features, [probe_dense])
                np.testing.assert_allclose(answer, versions[-1], rtol=0, atol=1e-6)
            finally:
                prober.stop.set()
                prober.join(30)
            assert prober.error is None, prober.error

            # The newest rows, and no expired one.
            trainer = PSClient(f"127.0.0.1:{ps_port}", common)
            follower = PSClient(serving_ps, common)
            try:
                want = trainer.lookup([("user", new_users), ("item", np.arange(41, 81,
                                                                                dtype=np.uint64))],
                                      training=False)
                expired = {t.table: t.expired for t in trainer.stats().tables}
                assert expired["user"] >= old_users.size, expired

                def serving_rows() -> list[np.ndarray]:
                    return follower.lookup([("user", new_users),
                                            ("item", np.arange(41, 81, dtype=np.uint64))],
                                           training=False)

                # Each applied increment is logged: check again after each until equal.
                while not all(np.array_equal(a, b) for a, b in zip(serving_rows(), want)):
                    serve.wait_for_line(r"\[ps-0\] .*applied increment", 60)
                (forgotten,) = follower.lookup([("user", old_users)], training=False)
                assert not forgotten.any(), "expired ids are still served"
                entries = {t.table: t.entries for t in follower.stats().tables}
                assert entries["user"] == new_users.size, entries
            finally:
                trainer.close()
                follower.close()
                client.close()

        # Every answer came from one whole version: the base model or one exported since
        # (they differ from each other far more than the tolerance).
        versions = np.stack(versions)
        gaps = [np.abs(a - b).max() for i, a in enumerate(versions) for b in versions[i + 1:]]
        assert min(gaps) > 1e-4, gaps
        matched = [int(np.flatnonzero(np.abs(versions - out).max(axis=(1, 2)) <= 1e-6)[0])
                   if (np.abs(versions - out).max(axis=(1, 2)) <= 1e-6).any() else -1
                   for out in prober.outputs]
        assert -1 not in matched, "an answer matches no complete dense version"
        assert matched[0] == 0 and matched[-1] == len(versions) - 1, matched

        # Freshness: exposed, and a WARNING once nothing new comes for 2 intervals.
        samples = _scrape(ps_metrics.group(1))
        assert samples["persia_serving_increments_applied_total"] >= 1
        assert samples["persia_serving_increment_age_seconds"] >= 0
        samples = _scrape(serve_metrics)
        assert samples["persia_serving_dense_models_loaded_total"] >= 1
        assert samples["persia_serving_dense_model_age_seconds"] >= 0
        if "falls behind" not in serve.output():
            serve.wait_for_line(r"newest applied increment is .* falls behind", 60)
    finally:
        if serve is not None:
            serve.stop()
        ew.stop()
        ps.stop()
    assert "Traceback" not in serve.output(), serve.output()

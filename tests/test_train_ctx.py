"""TrainCtx over real servers: the staleness bound holds, lookups run ahead of training,
and every batch a data loader sends is trained exactly once."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from conftest import start_server

from persia_py.config import CommonConfig, GlobalConfig, NNWorkerConfig
from persia_py.ctx import DataCtx, TrainCtx
from persia_py.data import DataLoader, StreamingDataset
from persia_py.embedding.data import IDTypeFeature, Label, NonIDTypeFeature, PersiaBatch
from persia_py.embedding.optim import SGD
from persia_py.env import PersiaEnv
from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient

NUM_BATCHES = 12
GLOBAL = GlobalConfig(common_config=CommonConfig(rpc_timeout_sec=30, startup_timeout_sec=60))


@pytest.fixture(scope="module")
def embedding_worker(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_ctx")
    (root / "embedding_config.yml").write_text(
        "slots_config:\n  user:\n    dim: 4\n  tags:\n    dim: 4\n    pooling: mean\n")
    config = ["--embedding-config", str(root / "embedding_config.yml")]
    ps, ps_port = start_server("embedding-parameter-server", *config)
    ew, ew_port = start_server("embedding-worker", *config, "--ps-addrs", f"127.0.0.1:{ps_port}")
    yield f"127.0.0.1:{ew_port}"
    ew.stop()
    ps.stop()


def _batches():
    rng = np.random.default_rng(0)
    for _ in range(NUM_BATCHES):
        lengths = rng.integers(0, 4, 16)
        yield PersiaBatch(
            [IDTypeFeature.from_csr("user", rng.integers(0, 50, 16).astype(np.uint64),
                                    np.ones(16, np.int32)),
             IDTypeFeature.from_csr("tags", rng.integers(0, 50, lengths.sum()).astype(np.uint64),
                                    lengths)],
            non_id_type_features=[NonIDTypeFeature(rng.normal(size=(16, 2)).astype(np.float32))],
            labels=[Label(rng.integers(0, 2, (16, 1)).astype(np.float32))],
        )


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(10, 1)

    def forward(self, dense, embeddings):
        return torch.sigmoid(self.linear(torch.cat([dense[0], *embeddings], dim=1)))


def _start_loader(embedding_worker: str, global_config: GlobalConfig = GLOBAL):
    """A DataCtx serving NUM_BATCHES batches from a thread; returns (ctx, thread, errors)."""
    ready, errors = threading.Event(), []
    env = PersiaEnv(embedding_worker_addrs=(embedding_worker,), nn_world_size=1)
    data_ctx = DataCtx(port=0, env=env, global_config=global_config)

    def run():
        try:
            with data_ctx:
                ready.set()
                for batch in _batches():
                    data_ctx.send_data(batch)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            ready.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert ready.wait(timeout=60) and not errors, errors
    return data_ctx, thread, errors


def _train(embedding_worker: str, data_ctx: DataCtx, *, staleness: int,
           global_config: GlobalConfig = GLOBAL, mixed_precision: bool = False,
           reproducible: bool = False, on_step=None):
    """Train on the loader's stream; returns (steps, losses, ctx)."""
    model = Model()
    env = PersiaEnv(embedding_worker_addrs=(embedding_worker,),
                    data_loader_addrs=(f"127.0.0.1:{data_ctx.port}",))
    losses = []
    with TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1),
                  dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  global_config=global_config, env=env,
                  mixed_precision=mixed_precision) as ctx:
        for batch in DataLoader(StreamingDataset(buffer_size=4), reproducible=reproducible,
                                embedding_staleness=staleness):
            output, labels = ctx.forward(batch)
            loss = torch.nn.functional.binary_cross_entropy(output.float(), labels[0])
            ctx.backward(loss)
            losses.append(loss.item())
            if on_step is not None:
                on_step(len(losses))
    return len(losses), losses, ctx


def test_byte_budget_bounds_what_the_pipeline_holds(embedding_worker) -> None:
    budget = 6000  # about three batches with their gradients
    config = GlobalConfig(common_config=GLOBAL.common_config,
                          nn_worker_config=NNWorkerConfig(max_buffer_bytes=budget))
    data_ctx, thread, errors = _start_loader(embedding_worker)
    steps, _, ctx = _train(embedding_worker, data_ctx, staleness=8, global_config=config)
    thread.join(timeout=60)
    assert steps == NUM_BATCHES and not errors
    assert 0 < ctx.budget.peak <= budget
    assert ctx.budget.used == 0


def test_wire_fp16_lz4_and_cpu_mixed_precision_train(embedding_worker) -> None:
    common = CommonConfig(rpc_timeout_sec=30, startup_timeout_sec=60, embedding_fp16=True,
                          lz4_compression=True)
    config = GlobalConfig(common_config=common)
    data_ctx, thread, errors = _start_loader(embedding_worker, config)
    steps, losses, _ = _train(embedding_worker, data_ctx, staleness=2, global_config=config,
                              mixed_precision=True)
    thread.join(timeout=60)
    assert steps == NUM_BATCHES and not errors
    assert np.isfinite(losses).all()


def test_reproducible_needs_staleness_one(embedding_worker) -> None:
    data_ctx, thread, _ = _start_loader(embedding_worker)
    with pytest.raises(ValueError, match="reproducible=True needs embedding_staleness=1"):
        _train(embedding_worker, data_ctx, staleness=3, reproducible=True)
    # The stream was never read; a correct run drains it.
    steps, _, _ = _train(embedding_worker, data_ctx, staleness=1, reproducible=True)
    thread.join(timeout=60)
    assert steps == NUM_BATCHES


@pytest.mark.parametrize("staleness", [1, 3])
def test_staleness_bound_holds_and_every_batch_trains_once(embedding_worker, monkeypatch,
                                                           staleness: int) -> None:
    state = {"looked_up": 0, "acked": 0, "max_ahead": 0}
    changed = threading.Condition()
    acks_open = threading.Event()
    real_lookup, real_update = EmbeddingWorkerClient.lookup, EmbeddingWorkerClient.update_gradients

    def lookup(self, ref):
        rows = real_lookup(self, ref)
        with changed:
            state["looked_up"] += 1
            state["max_ahead"] = max(state["max_ahead"], state["looked_up"] - state["acked"])
            changed.notify_all()
        return rows

    def update_gradients(self, ref, grads):
        assert acks_open.wait(timeout=60)
        num = real_update(self, ref, grads)
        with changed:
            state["acked"] += 1
        return num

    monkeypatch.setattr(EmbeddingWorkerClient, "lookup", lookup)
    monkeypatch.setattr(EmbeddingWorkerClient, "update_gradients", update_gradients)

    def on_step(steps: int) -> None:
        if steps == staleness:
            # `staleness` batches looked up, none acknowledged: the look-ahead has filled
            # the bound (lookups ran ahead of training) and must stop there.
            with changed:
                assert changed.wait_for(lambda: state["looked_up"] == staleness, timeout=30)
            acks_open.set()

    data_ctx, thread, errors = _start_loader(embedding_worker)
    steps, _, _ = _train(embedding_worker, data_ctx, staleness=staleness, on_step=on_step)
    thread.join(timeout=60)
    assert not thread.is_alive() and not errors
    assert steps == NUM_BATCHES == data_ctx.num_sent
    assert state["looked_up"] == state["acked"] == NUM_BATCHES
    assert state["max_ahead"] == staleness


def test_a_failed_lookup_stops_training_with_its_error(embedding_worker, monkeypatch) -> None:
    # Staleness 3 runs two lookup threads: the failing one's error must reach the
    # training loop even when the other one finishes the stream.
    real_lookup, calls = EmbeddingWorkerClient.lookup, []

    def lookup(self, ref):
        calls.append(ref)
        if len(calls) == 3:
            raise ConnectionError("lookup 3 failed")
        return real_lookup(self, ref)

    monkeypatch.setattr(EmbeddingWorkerClient, "lookup", lookup)
    data_ctx, thread, errors = _start_loader(embedding_worker)
    with pytest.raises(RuntimeError, match="batch pipeline failed: lookup 3 failed"):
        _train(embedding_worker, data_ctx, staleness=3)
    monkeypatch.undo()
    _train(embedding_worker, data_ctx, staleness=3)  # drains the loader's other batches
    thread.join(timeout=60)
    assert not thread.is_alive() and not errors

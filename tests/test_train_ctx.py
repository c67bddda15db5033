"""TrainCtx over real servers: the staleness bound holds, lookups run ahead of training,
and every batch a data loader sends, or a dataset of this process yields, is trained
exactly once; checkpoints go through the context's state interface."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from child_processes import start_server

from persia_py.checkpoint import layout as fmt
from persia_py.checkpoint.coordinator import Checkpointer
from persia_py.config import (
    CheckpointConfig,
    CommonConfig,
    ConfigError,
    GlobalConfig,
    NNWorkerConfig,
)
from persia_py.ctx import DataCtx, InferCtx, TrainCtx, eval_ctx
from persia_py.data import DataLoader, IterableDataset, StreamingDataset
from persia_py.distributed import FSDPOption
from persia_py.embedding.data import IDTypeFeature, Label, NonIDTypeFeature, PersiaBatch
from persia_py.embedding.optim import SGD
from persia_py.env import PersiaEnv
from persia_py.ops.final_errors import is_config_error
from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient

pytestmark = pytest.mark.processes

NUM_BATCHES = 12
COMMON = CommonConfig(rpc_timeout_sec=30, startup_timeout_sec=60)
GLOBAL = GlobalConfig(common_config=COMMON)


@dataclass(frozen=True)
class Cluster:
    embedding_worker: str
    ps: str
    checkpoint_root: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_ctx")
    checkpoints = root / "checkpoints"
    checkpoints.mkdir()
    (root / "embedding_config.yml").write_text(
        "slots_config:\n  user:\n    dim: 4\n  tags:\n    dim: 4\n    pooling: mean\n")
    (root / "global_config.yml").write_text(f"checkpoint_config:\n  root: {checkpoints}\n")
    config = ["--embedding-config", str(root / "embedding_config.yml")]
    ps, ps_port = start_server("embedding-parameter-server", *config,
                               "--global-config", str(root / "global_config.yml"))
    ew, ew_port = start_server("embedding-worker", *config, "--ps-addrs", f"127.0.0.1:{ps_port}")
    yield Cluster(f"127.0.0.1:{ew_port}", f"127.0.0.1:{ps_port}", checkpoints)
    ew.stop()
    ps.stop()


@pytest.fixture(scope="module")
def embedding_worker(cluster: Cluster) -> str:
    return cluster.embedding_worker


def _batches(requires_grad: bool = True):
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
            requires_grad=requires_grad,
        )


class Batches(IterableDataset):
    """The same batches as the data loader sends, made in this process."""

    def __init__(self, requires_grad: bool = True) -> None:
        super().__init__(buffer_size=4)
        self.requires_grad = requires_grad

    def __iter__(self):
        return _batches(self.requires_grad)


class Model(torch.nn.Module):
    """Not scriptable: TorchScript cannot infer the list arguments' types."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(10, 1)

    def forward(self, dense, embeddings):
        return torch.sigmoid(self.linear(torch.cat([dense[0], *embeddings], dim=1)))


class ScriptableModel(Model):
    def forward(self, dense: list[torch.Tensor],
                embeddings: list[torch.Tensor]) -> torch.Tensor:
        return torch.sigmoid(self.linear(torch.cat([dense[0]] + embeddings, dim=1)))


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


def _train(embedding_worker: str, data_ctx: DataCtx | None, *, staleness: int,
           global_config: GlobalConfig = GLOBAL, mixed_precision: bool = False,
           reproducible: bool = False, on_step=None):
    """Train on the loader's stream (on ``Batches()`` made here without ``data_ctx``);
    returns (steps, losses, ctx)."""
    model = Model()
    env = PersiaEnv(embedding_worker_addrs=(embedding_worker,),
                    data_loader_addrs=(f"127.0.0.1:{data_ctx.port}",) if data_ctx else ())
    dataset = StreamingDataset(buffer_size=4) if data_ctx else Batches()
    losses = []
    with TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1),
                  dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  global_config=global_config, env=env,
                  mixed_precision=mixed_precision) as ctx:
        for batch in DataLoader(dataset, reproducible=reproducible,
                                embedding_staleness=staleness):
            output, labels = ctx.forward(batch)
            loss = torch.nn.functional.binary_cross_entropy(output.float(), labels[0])
            ctx.backward(loss)
            losses.append(loss.item())
            if on_step is not None:
                on_step(len(losses))
    return len(losses), losses, ctx


@pytest.mark.parametrize("source", ["data loader", "this process"])
def test_byte_budget_bounds_what_the_pipeline_holds(embedding_worker, source: str) -> None:
    budget = 6000  # about three batches with their gradients
    config = GlobalConfig(common_config=GLOBAL.common_config,
                          nn_worker_config=NNWorkerConfig(max_buffer_bytes=budget))
    data_ctx, thread, errors = (_start_loader(embedding_worker) if source == "data loader"
                                else (None, None, []))
    steps, _, ctx = _train(embedding_worker, data_ctx, staleness=8, global_config=config)
    if thread is not None:
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


@pytest.mark.parametrize("source", ["data loader", "this process"])
@pytest.mark.parametrize("staleness", [1, 3])
def test_staleness_bound_holds_and_every_batch_trains_once(embedding_worker, monkeypatch,
                                                           staleness: int, source: str) -> None:
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

    if source == "this process":
        steps, _, _ = _train(embedding_worker, None, staleness=staleness, on_step=on_step)
        assert steps == NUM_BATCHES
    else:
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
    # The other lookup thread may have taken the stream's end already (seen once in a full
    # suite run): the loader then stops once its batches' wait runs out, and there is
    # nothing left to drain. Otherwise a second run drains the loader's other batches.
    if not data_ctx.batches.wait_all_ended(0):
        _train(embedding_worker, data_ctx, staleness=3)
    thread.join(timeout=60)
    assert not thread.is_alive() and not errors


def _ctx(cluster: Cluster, model: torch.nn.Module) -> TrainCtx:
    env = PersiaEnv(embedding_worker_addrs=(cluster.embedding_worker,), ps_addrs=(cluster.ps,))
    config = GlobalConfig(common_config=COMMON, checkpoint_config=CheckpointConfig(
        root=str(cluster.checkpoint_root)))
    return TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1),
                    dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    global_config=config, env=env)


def _train_here(ctx: TrainCtx) -> int:
    steps = 0
    for batch in DataLoader(Batches(), embedding_staleness=2):
        output, labels = ctx.forward(batch)
        ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
        steps += 1
    return steps


def test_checkpoint_round_trip_through_the_state_interface_with_jit_model(cluster) -> None:
    model = ScriptableModel()
    with _ctx(cluster, model) as ctx:
        assert set(ctx.state_dict()) == {"model", "dense_optimizer", "train_state"}
        assert _train_here(ctx) == NUM_BATCHES
        folder = ctx.dump_checkpoint(str(cluster.checkpoint_root), with_jit_model=True)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        # The TorchScript computes what the model does.
        scripted = torch.jit.load(str(folder / "jit_dense.pt"))
        dense, embeddings = [torch.randn(3, 2)], [torch.randn(3, 4), torch.randn(3, 4)]
        assert torch.equal(scripted(dense, embeddings), model(dense, embeddings))
        assert _train_here(ctx) == NUM_BATCHES
        assert ctx.checkpointer.steps == 2 * NUM_BATCHES
        assert any(not torch.equal(v, saved[k]) for k, v in model.state_dict().items())
        ctx.load_checkpoint(str(folder))
        assert ctx.checkpointer.steps == ctx.train_state.steps == NUM_BATCHES
        assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


def test_dump_checkpoint_refuses_an_unscriptable_model_before_writing(cluster) -> None:
    with _ctx(cluster, Model()) as ctx:
        before = sorted(p.name for p in cluster.checkpoint_root.iterdir())
        with pytest.raises(ValueError, match="torch.jit.script cannot compile the dense model "
                                             "Model"):
            ctx.dump_checkpoint(str(cluster.checkpoint_root), with_jit_model=True)
        with pytest.raises(ValueError, match="blocking=False"):
            ctx.dump_checkpoint(str(cluster.checkpoint_root), blocking=False)
        with pytest.raises(ValueError, match="jit_dense_filename"):
            ctx.dump_checkpoint(str(cluster.checkpoint_root), with_jit_model=True,
                                jit_dense_filename="../x.pt")
        assert sorted(p.name for p in cluster.checkpoint_root.iterdir()) == before


def test_checkpointer_takes_only_stateful_parts() -> None:
    model = torch.nn.Linear(1, 1)
    states = {"model": model, "dense_optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
              "train_state": 3}
    with pytest.raises(TypeError, match=r"not Stateful: \['train_state'\]"):
        Checkpointer(states, flush=lambda: None, ps_addrs=[], common=COMMON,
                     config=CheckpointConfig(), device=torch.device("cpu"))


def test_forward_of_a_raw_batch_says_what_to_do(cluster) -> None:
    raw = next(_batches())
    with _ctx(cluster, Model()) as ctx:
        with pytest.raises(TypeError, match="DataLoader; got a raw PersiaBatch"):
            ctx.forward(raw)
        with pytest.raises(ValueError, match=r"DataLoader\(IterableDataset\)"):
            ctx.prepare(raw)  # a training batch skips no bound
        with eval_ctx(ctx.model) as evaluation:
            with pytest.raises(TypeError, match="DataLoader; got a raw PersiaBatch"):
                evaluation.forward(raw)


def test_parts_built_on_entering_say_so_before_it(cluster) -> None:
    ctx = _ctx(cluster, Model())
    for part in ("checkpointer", "reporter"):
        with pytest.raises(RuntimeError, match=rf"TrainCtx.{part} is built when the context "
                                               "is entered"):
            getattr(ctx, part)
    with ctx:
        assert ctx.checkpointer.steps == 0
        with pytest.raises(TypeError, match="TrainCtx.forward takes no model="):
            ctx.forward(next(_batches()), model=ctx.model)


def test_eval_ctx_reads_a_dataset_of_this_process(cluster) -> None:
    with _ctx(cluster, Model()) as ctx, eval_ctx(ctx.model) as evaluation:
        outputs = [evaluation.forward(batch)[0]
                   for batch in DataLoader(Batches(requires_grad=False), embedding_staleness=2)]
        assert len(outputs) == NUM_BATCHES and all(o.shape == (16, 1) for o in outputs)
        with pytest.raises(RuntimeError, match="this context only evaluates"):
            for _ in DataLoader(Batches()):
                pass


def test_infer_ctx_takes_persia_arguments_and_only_evaluates(cluster) -> None:
    with _ctx(cluster, Model()):
        pass  # configures the servers, as the training job before a serving job does
    model = Model()
    with InferCtx([cluster.embedding_worker], model=model, global_config=GLOBAL,
                  env=PersiaEnv()) as ctx:
        assert not model.training
        ctx.wait_for_serving()
        output, labels = ctx.forward(ctx.prepare(next(_batches(requires_grad=False))))
        assert output.shape == (16, 1) and labels[0].shape == (16, 1)
        with pytest.raises(ValueError, match="this context only evaluates"):
            ctx.prepare(next(_batches()))
    assert model.training


def test_leaving_a_loop_early_gives_back_the_budget(cluster) -> None:
    with _ctx(cluster, Model()) as ctx:
        loader = iter(DataLoader(Batches(), embedding_staleness=4))
        output, labels = ctx.forward(next(loader))
        ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
        loader.close()  # batches looked up ahead are never trained
        ctx.flush()
        assert ctx.budget.used == 0


def test_a_stop_at_a_periodic_step_keeps_two_distinct_checkpoints(cluster, caplog) -> None:
    """The final checkpoint of a stop right after a periodic one is that one: a second
    folder of the same cut would leave the two kept checkpoints one step, pruning the
    distinct one before."""
    root = cluster.checkpoint_root / "stop-at-periodic"
    config = GlobalConfig(common_config=COMMON, checkpoint_config=CheckpointConfig(
        root=str(cluster.checkpoint_root), dir=str(root), every_steps=4))
    data_ctx, thread, errors = _start_loader(cluster.embedding_worker)
    model = Model()
    env = PersiaEnv(embedding_worker_addrs=(cluster.embedding_worker,), ps_addrs=(cluster.ps,),
                    data_loader_addrs=(f"127.0.0.1:{data_ctx.port}",))
    with caplog.at_level("INFO", logger="persia_py.checkpoint.coordinator"), TrainCtx(
            model=model, embedding_optimizer=SGD(lr=0.1), global_config=config, env=env,
            dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            stop_on_signal=True) as ctx:
        for batch in DataLoader(StreamingDataset(buffer_size=4), embedding_staleness=2):
            output, labels = ctx.forward(batch)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
            if ctx.checkpointer.steps == NUM_BATCHES:  # the last batch, a periodic step
                ctx.stop.request()  # as SIGTERM does
    thread.join(timeout=60)
    assert not thread.is_alive() and not errors
    steps = sorted(fmt.read_manifest(p)["step"] for p in root.glob("ckpt-*"))
    assert steps == [NUM_BATCHES - 4, NUM_BATCHES], steps
    assert f"training ended (a signal) at step {NUM_BATCHES}; final checkpoint " \
           f"{fmt.resolve(root)}" in caplog.text, caplog.text


def test_config_errors_are_refused_when_the_context_is_made(cluster) -> None:
    model = Model()
    env = PersiaEnv(embedding_worker_addrs=(cluster.embedding_worker,), ps_addrs=(cluster.ps,))
    outside = cluster.checkpoint_root.parent / "elsewhere"

    def make(checkpoints: CheckpointConfig, **kwargs) -> TrainCtx:
        kwargs.setdefault("env", env)
        return TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1),
                        dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        global_config=GlobalConfig(common_config=COMMON,
                                                   checkpoint_config=checkpoints), **kwargs)

    # Not at the first periodic checkpoint, after training up to it.
    with pytest.raises(ConfigError, match=rf"^checkpoint_config.dir: '{outside}' lies outside "
                                          rf"the checkpoint root {cluster.checkpoint_root} "):
        make(CheckpointConfig(root=str(cluster.checkpoint_root), dir=str(outside),
                              every_steps=4))
    # Not at the end, with no checkpoint to go on from.
    with pytest.raises(ConfigError, match=r"^checkpoint_config.dir: required with "
                                          r"TrainCtx\(stop_on_signal=True\)"):
        make(CheckpointConfig(root=str(cluster.checkpoint_root)), stop_on_signal=True)
    # What FSDP over several ranks cannot do: before the process group, not after.
    two_ranks = PersiaEnv(rank=0, world_size=2, local_rank=0, ps_addrs=(cluster.ps,),
                          embedding_worker_addrs=(cluster.embedding_worker,))
    root = str(cluster.checkpoint_root)
    with pytest.raises(ValueError, match=r"grad_accumulation_steps=...\) > 1 is not supported "
                                         r"with FSDPOption on several ranks") as refused:
        make(CheckpointConfig(root=root), env=two_ranks, distributed_option=FSDPOption(),
             grad_accumulation_steps=2)
    # Uncaught in a script persia-launcher started, it ends the role for good.
    assert is_config_error(refused.value)
    with pytest.raises(ConfigError, match=r"^checkpoint_config.dense_export_dir: dense exports "
                                          r"for serving need a whole model on rank 0"):
        make(CheckpointConfig(root=root, dense_export_dir=f"{root}/dense",
                              dense_export_every_steps=2),
             env=two_ranks, distributed_option=FSDPOption())


def test_a_rank_and_a_loader_make_progress_with_their_first_step_and_batch(
        embedding_worker, monkeypatch) -> None:
    """From then on an uncaught config error is an ordinary failure, which the role's
    supervisor restarts (persia_py/ops/final_errors.py); entering a context is no progress."""
    calls: list[object] = []
    monkeypatch.setattr("persia_py.workers.data_loader.made_progress",
                        lambda: calls.append("loader"))
    monkeypatch.setattr("persia_py.ctx.train_ctx.made_progress", lambda: calls.append("rank"))
    data_ctx, thread, errors = _start_loader(embedding_worker)
    steps, _, _ = _train(embedding_worker, data_ctx, staleness=1, on_step=calls.append)
    thread.join(timeout=60)
    assert not thread.is_alive() and not errors
    assert calls.count("loader") == 1
    assert [c for c in calls if c != "loader"] == ["rank", *range(1, steps + 1)]

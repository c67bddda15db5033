"""Contexts of the user's processes (as PERSIA's ``persia.ctx``).

* :class:`TrainCtx` — an NN worker that trains: DDP over the dense tower, embeddings
  looked up ahead within the ``embedding_staleness`` bound, gradients sent back.
* :func:`eval_ctx` / :class:`InferCtx` — forward only; lookups never insert rows.
* :class:`DataCtx` — a data-loader process (see :mod:`persia_py.workers.data_loader`).
"""

from __future__ import annotations

import contextvars
import io
import itertools
import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from persia_py.checkpoint import Checkpointer
from persia_py.checkpoint_format import check_name
from persia_py.config import GlobalConfig, load_global_config
from persia_py.distributed import (
    DDPOption,
    DenseParallel,
    FSDPOption,
    is_deferred,
    materialize,
)
from persia_py.embedding import EmbeddingConfig
from persia_py.embedding.data import PersiaBatch
from persia_py.embedding.optim import Optimizer
from persia_py.env import ENV_EMBEDDING_WORKER_ADDRS, PersiaEnv
from persia_py.process_group import (
    PeerFailure,
    init_process_group,
    naming_peers,
    report_failure,
)
from persia_py.progress import StepReporter
from persia_py.stateful import Stateful, TrainState
from persia_py.workers.budget import ByteBudget
from persia_py.workers.data_loader import DataCtx
from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient
from persia_py.workers.nn_worker import (
    BatchStream,
    DataLoaderSource,
    GradientSender,
    LocalSource,
    TrainingBatch,
    look_up,
    pool_slot,
)
from persia_py.workers.ps_client import configure_request

__all__ = ["TrainCtx", "InferCtx", "DataCtx", "eval_ctx", "current_ctx"]

logger = logging.getLogger(__name__)

_current: contextvars.ContextVar[EmbeddingCtx | None] = contextvars.ContextVar(
    "persia_py_ctx", default=None
)


def current_ctx() -> EmbeddingCtx:
    """The innermost active context; RuntimeError outside one."""
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError("no persia_py context is active; use `with TrainCtx(...)`, "
                           "`with eval_ctx(...)` or `with InferCtx(...)`")
    return ctx


def _check_batch(batch: object) -> None:
    """``ctx.forward``'s argument must be a looked-up batch, not a raw one."""
    if isinstance(batch, TrainingBatch):
        return
    if isinstance(batch, PersiaBatch):
        raise TypeError(
            "ctx.forward takes a batch whose embeddings are looked up, from "
            "persia_py.data.DataLoader; got a raw PersiaBatch. Yield it from a "
            "persia_py.data.IterableDataset and iterate DataLoader(dataset) (or, for one "
            "evaluation batch, pass ctx.prepare(batch))")
    raise TypeError(f"ctx.forward takes a batch from persia_py.data.DataLoader, got "
                    f"{type(batch).__name__}")


class EmbeddingCtx:
    """Forward passes with embeddings from the embedding workers (the base of the contexts)."""

    _training = False
    """Whether this context trains (stores the ids of training batches, sends gradients)."""

    def __init__(self, *, model: torch.nn.Module | None = None,
                 embedding_worker_addresses: list[str] | None = None,
                 global_config: GlobalConfig | None = None, device_id: int | None = None,
                 env: PersiaEnv | None = None) -> None:
        self.env = env or PersiaEnv.from_environ()
        self.global_config = global_config or load_global_config(self.env.global_config)
        self.common = self.global_config.common_config
        self.model = model
        self.device = torch.device("cpu") if device_id is None else torch.device("cuda", device_id)
        self._addresses = list(embedding_worker_addresses or self.env.embedding_worker_addrs)
        self.workers: list[EmbeddingWorkerClient] = []
        self._owns_workers = True
        self.mixed_precision = False
        self._token: contextvars.Token | None = None
        self._round_robin = itertools.count()
        self.budget = ByteBudget(self.global_config.nn_worker_config.max_buffer_bytes,
                                 "nn_worker_config.max_buffer_bytes")
        """Bytes held by looked-up batches and their gradients not yet acknowledged."""

    def __enter__(self):
        if not self._addresses:
            raise RuntimeError(f"{ENV_EMBEDDING_WORKER_ADDRS} is not set; start this process "
                               "with persia-launcher or pass embedding_worker_addresses")
        self.workers = [EmbeddingWorkerClient(a, self.common) for a in self._addresses]
        for w in self.workers:
            w.wait_ready()
        self._token = _current.set(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None
        if self._owns_workers:
            for w in self.workers:
                w.close()

    # -- batches -----------------------------------------------------------------------

    def prepare(self, batch: PersiaBatch) -> TrainingBatch:
        """Look up the embeddings of one evaluation batch made in this process (e.g. a
        serving request); no rows are inserted. A dataset of batches goes through
        :class:`persia_py.data.DataLoader`, which looks ahead."""
        return look_up(batch, self.workers, training=False,
                       next_worker=next(self._round_robin) % len(self.workers))

    def stream_local(self, batches: Iterable[PersiaBatch], *, buffer_size: int,
                     reproducible: bool, embedding_staleness: int) -> Iterator[TrainingBatch]:
        """Batches made in this process, looked up ahead within the same staleness bound
        and byte budget as the data loaders' stream (``DataLoader(IterableDataset)``)."""
        stream = BatchStream(source=LocalSource(batches), workers=self.workers,
                             staleness=embedding_staleness, buffer_size=buffer_size,
                             reproducible=reproducible, budget=self.budget,
                             training=self._training)
        try:
            yield from stream
        finally:
            stream.close()

    def stream_from_loaders(self, *, buffer_size: int, reproducible: bool,
                            embedding_staleness: int) -> Iterator[TrainingBatch]:
        """The data loaders' stream (``DataLoader(StreamingDataset)``); TrainCtx only."""
        raise RuntimeError("a StreamingDataset is read for training; use it inside TrainCtx")

    def _embedding_tensors(self, batch: TrainingBatch, requires_grad: bool):
        rows = [torch.from_numpy(s.rows).to(self.device).requires_grad_(requires_grad)
                for s in batch.slots]
        return rows, [pool_slot(r, s) for r, s in zip(rows, batch.slots)]

    def _autocast(self):
        if not self.mixed_precision:
            return nullcontext()
        dtype = torch.float16 if self.device.type == "cuda" else torch.bfloat16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def forward(self, batch: TrainingBatch):
        """Run the model on ``batch``; returns ``(output, labels)`` (as PERSIA)."""
        _check_batch(batch)
        if self.model is None:
            raise RuntimeError("this context has no model")
        with torch.no_grad(), self._autocast():
            _, embeddings = self._embedding_tensors(batch, requires_grad=False)
            dense = [t.to(self.device) for t in batch.non_id_type_features]
            output = self.model(dense, embeddings)
        return output, [t.to(self.device) for t in batch.labels]


class InferCtx(EmbeddingCtx):
    """Context of an inference process, e.g. a serving replica (as PERSIA's ``InferCtx``).

    Forward only: lookups never insert rows, training batches are refused, and the model
    is in eval mode inside the context (its mode is restored on exit).

    Args:
        embedding_worker_address_list: PERSIA's first argument: the embedding workers to
            look up in (default: ``PERSIA_EMBEDDING_WORKER_ADDRS``). ``embedding_worker_addresses``
            is the same, by this package's name; give at most one.
        model, global_config, device_id, env: as :class:`TrainCtx`.
    """

    def __init__(self, embedding_worker_address_list: list[str] | None = None, *,
                 model: torch.nn.Module | None = None,
                 embedding_worker_addresses: list[str] | None = None,
                 global_config: GlobalConfig | None = None, device_id: int | None = None,
                 env: PersiaEnv | None = None) -> None:
        if embedding_worker_address_list is not None and embedding_worker_addresses is not None:
            raise ValueError("give embedding_worker_address_list or embedding_worker_addresses, "
                             "not both")
        super().__init__(model=model, global_config=global_config, device_id=device_id, env=env,
                         embedding_worker_addresses=(embedding_worker_address_list
                                                     or embedding_worker_addresses))
        self._was_training: bool | None = None

    def __enter__(self) -> InferCtx:
        super().__enter__()
        if self.model is not None:
            self._was_training = self.model.training
            self.model.eval()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.model is not None and self._was_training is not None:
            self.model.train(self._was_training)
        super().__exit__(exc_type, exc, tb)

    def wait_for_serving(self) -> None:
        """PERSIA's wait until the embedding workers serve: entering this context already
        waited for each (``common_config.startup_timeout_sec``), so inside it this returns
        at once; outside it, RuntimeError."""
        if self._token is None:
            raise RuntimeError("wait_for_serving is called inside `with InferCtx(...)`, which "
                               "waits for the embedding workers on entry")


@contextmanager
def eval_ctx(model: torch.nn.Module) -> Iterator[EmbeddingCtx]:
    """Evaluate ``model`` inside the current context, sharing its connections."""
    outer = current_ctx()
    ctx = EmbeddingCtx(model=model, global_config=outer.global_config, env=outer.env)
    ctx.device = outer.device
    ctx.mixed_precision = outer.mixed_precision
    ctx.workers, ctx._owns_workers = outer.workers, False
    ctx._token = _current.set(ctx)
    was_training = model.training
    model.eval()
    try:
        yield ctx
    finally:
        model.train(was_training)
        _current.reset(ctx._token)


class TrainCtx(EmbeddingCtx):
    """Context of a training NN worker (as PERSIA's ``TrainCtx``).

    Args:
        model: the dense tower; called as ``model(non_id_tensors, embedding_tensors)``.
            One from :func:`persia_py.distributed.build_on_meta` (parameters on the meta
            device) is materialized on entry, unit by unit under ``FSDPOption``.
        embedding_optimizer: :mod:`persia_py.embedding.optim` optimizer, run on the servers.
        dense_optimizer: a ``torch.optim`` optimizer over ``model``'s parameters.
        embedding_config: initialization bounds, weight bound and seed of new rows.
        device_id: CUDA device, or None for CPU.
        mixed_precision: run the model under autocast: float16 with a gradient scaler on
            CUDA, bfloat16 on CPU. Embedding rows stay float32 on the servers.
        distributed_option: how the ranks share the dense tower:
            :class:`~persia_py.distributed.DDPOption` (default; a replica per rank) or
            :class:`~persia_py.distributed.FSDPOption` (sharded, with a bound on the
            unsharded bytes alive at once).
    """

    _training = True

    def __init__(self, *, model: torch.nn.Module, embedding_optimizer: Optimizer,
                 dense_optimizer: torch.optim.Optimizer,
                 embedding_config: EmbeddingConfig | None = None,
                 device_id: int | None = None, mixed_precision: bool = False,
                 global_config: GlobalConfig | None = None, env: PersiaEnv | None = None,
                 distributed_option: DDPOption | FSDPOption | None = None) -> None:
        super().__init__(model=model, global_config=global_config, device_id=device_id, env=env)
        if not isinstance(embedding_optimizer, Optimizer):
            raise TypeError("embedding_optimizer must come from persia_py.embedding.optim")
        self.distributed_option = distributed_option or DDPOption()
        if not isinstance(self.distributed_option, (DDPOption, FSDPOption)):
            raise TypeError("distributed_option must be a persia_py.distributed.DDPOption "
                            "or FSDPOption")
        # A bound below one unit's need is refused here, before any process starts.
        self.distributed_option.check(model, self.env.world_size)
        self.dense: DenseParallel = DenseParallel(model, model)
        """The dense tower as the ranks share it (DDP, FSDP, or whole with one rank)."""
        self._last_inputs: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.mixed_precision = mixed_precision
        self._scaler = (torch.amp.GradScaler("cuda")
                        if mixed_precision and self.device.type == "cuda" else None)
        self.embedding_optimizer = embedding_optimizer
        self.dense_optimizer = dense_optimizer
        self.embedding_config = embedding_config or EmbeddingConfig()
        self.ddp_model: torch.nn.Module = model
        self._sender: GradientSender | None = None
        self._pending: tuple[TrainingBatch, list[torch.Tensor]] | None = None
        self._owns_process_group = False
        self._rank_addresses: list[str] = []
        self._peer_failed = False
        self.staleness: int = 0
        """Staleness of the batch of the current step (see ``TrainingBatch.staleness``)."""
        self._staleness_sum = 0
        self._staleness_max = 0
        self._num_steps = 0  # in this context, for the staleness figures
        self.train_state = TrainState()
        """Batches this rank has trained, counting those before a resumed checkpoint."""
        self.checkpointer: Checkpointer | None = None
        self.reporter: StepReporter | None = None
        """Progress line, training log and metrics of this rank (see persia_py.progress)."""

    def __enter__(self) -> TrainCtx:
        super().__enter__()
        self.reporter = StepReporter.from_environ(self.env)
        if not is_deferred(self.model):  # a build_on_meta model is materialized by wrap
            self.model.to(self.device)
        elif self.env.world_size == 1:
            materialize(self.model, self.dense_optimizer, self.device)
        if self.env.world_size > 1:
            if not dist.is_initialized():
                backend = self.distributed_option.backend or (
                    "nccl" if self.device.type == "cuda" else "gloo")
                self._rank_addresses = init_process_group(backend, self.common)
                self._owns_process_group = True
            self.dense = self.distributed_option.wrap(
                self.model, self.dense_optimizer, self.device, shadow_step=self._shadow_step,
                registry=self.reporter.metrics.registry)
            self.ddp_model = self.dense.module
        cfg = self.embedding_config
        request = configure_request(
            self.embedding_optimizer.to_dict(), init_lower=cfg.emb_initialization[0],
            init_upper=cfg.emb_initialization[1], weight_bound=cfg.weight_bound, seed=cfg.seed,
        )
        for w in self.workers:
            w.configure(request)
        self._sender = GradientSender(self.workers, max_in_flight=8)
        self.checkpointer = Checkpointer(
            self.state_dict(), flush=self.flush, ps_addrs=self.env.ps_addrs, common=self.common,
            config=self.global_config.checkpoint_config, device=self.device,
            sharded_dense=self.dense.sharded)
        self.checkpointer.resume_if_asked()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and not isinstance(exc, KeyboardInterrupt):
            report_failure(self.env.rank, exc)
        if self._num_steps:
            logger.info("rank %d: %d steps, embedding staleness mean %.2f max %d, peak buffer "
                        "%d bytes", self.env.rank, self._num_steps,
                        self.mean_staleness, self._staleness_max,
                        self.budget.peak)
        if self.dense.summary():
            logger.info("rank %d: %s", self.env.rank, self.dense.summary())
        try:
            if self._sender is not None:
                if exc_type is None:
                    self._sender.flush(self.common.rpc_timeout_sec)
                self._sender.close()
            if self.checkpointer is not None:
                self.checkpointer.close()
        finally:
            if self.reporter is not None:
                self.reporter.close()
            if self._owns_process_group and dist.is_initialized() and not self._peer_failed:
                # After a peer failed, tearing the group down would wait on the store
                # behind the same dead link; exiting releases it anyway.
                dist.destroy_process_group()
            super().__exit__(exc_type, exc, tb)

    @property
    def mean_staleness(self) -> float:
        """Mean staleness of the batches trained so far in this context."""
        return self._staleness_sum / self._num_steps if self._num_steps else 0.0

    def flush(self) -> None:
        """Wait until the servers have acknowledged every embedding update sent so far."""
        self._sender.flush(self.common.rpc_timeout_sec)

    def state_dict(self) -> dict[str, Stateful]:
        """This rank's part of a checkpoint, as ``torch.distributed.checkpoint`` takes it:
        ``model`` (the dense model), ``dense_optimizer`` and ``train_state``
        (:class:`~persia_py.stateful.TrainState`), each a Stateful object read and
        restored in place. The embeddings live on the servers (see :meth:`dump_checkpoint`)."""
        return {"model": self.model, "dense_optimizer": self.dense_optimizer,
                "train_state": self.train_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict`'s parts' ``state_dict()`` returned, given as
        plain mappings under the same keys; every key is required."""
        parts = self.state_dict()
        if set(state_dict) != set(parts):
            raise ValueError(f"state_dict: expected the keys {sorted(parts)}, got "
                             f"{sorted(state_dict)}")
        for key, part in parts.items():
            part.load_state_dict(state_dict[key])

    def dump_checkpoint(self, dst_dir: str, *, with_jit_model: bool = False,
                        jit_dense_filename: str = "jit_dense.pt",
                        blocking: bool = True) -> Path | None:
        """Checkpoint embeddings with optimizer state, the dense model and optimizer, and
        the batches trained into ``dst_dir`` (see :mod:`persia_py.checkpoint`); every rank
        calls it at the same step. Returns the checkpoint folder on rank 0, else None.

        With ``with_jit_model`` (as PERSIA) the folder also holds the dense model compiled
        by ``torch.jit.script`` as ``jit_dense_filename`` (load it with ``torch.jit.load``);
        a model TorchScript cannot compile is a ``ValueError`` before anything is written.
        Dumps always block (``blocking=False`` is refused): a checkpoint is a cut that
        every rank waits for.
        """
        if not blocking:
            raise ValueError("blocking=False is not supported: every rank waits for the "
                             "checkpoint's consistent cut; call dump_checkpoint(dst_dir)")
        extra_files = {}
        if with_jit_model:
            check_name(jit_dense_filename, "jit_dense_filename")
            if not jit_dense_filename.endswith(".pt"):
                raise ValueError(f"jit_dense_filename: {jit_dense_filename!r} must end with "
                                 "'.pt'")
            extra_files[jit_dense_filename] = _torchscript(self.model)
        return self.checkpointer.dump(dst_dir, extra_files=extra_files)

    def load_checkpoint(self, src_dir: str) -> None:
        """Load a checkpoint written by :meth:`dump_checkpoint` (a root or one folder)."""
        self.checkpointer.load(src_dir)

    def log(self, **values: float) -> None:
        """Record numbers of this step (e.g. ``ctx.log(test_auc=auc)``) in the training log."""
        self.reporter.log(**values)

    def prepare(self, batch: PersiaBatch) -> TrainingBatch:
        """Look up one evaluation batch (see :meth:`EmbeddingCtx.prepare`)."""
        if batch.requires_grad:
            raise ValueError(
                "a training batch made in this process goes through "
                "persia_py.data.DataLoader(IterableDataset), which bounds its embedding "
                "staleness and bytes as for the data loaders' batches")
        return super().prepare(batch)

    def stream_local(self, batches: Iterable[PersiaBatch], *, buffer_size: int,
                     reproducible: bool, embedding_staleness: int) -> Iterator[TrainingBatch]:
        """Batches made in this process (see :meth:`EmbeddingCtx.stream_local`). Each rank
        reads its own dataset, and their lengths may differ: as with the data loaders'
        stream, a rank out of batches joins the others' steps until all are done."""
        with self._joined():
            yield from super().stream_local(batches, buffer_size=buffer_size,
                                            reproducible=reproducible,
                                            embedding_staleness=embedding_staleness)

    def _joined(self):
        """``torch.distributed.algorithms.Join`` over the dense tower (a rank out of
        batches shadows the others' collectives: DDP's allreduce, FSDP's gathers) and
        the checkpointer (its hook keeps periodic checkpoints from waiting for that
        rank); nothing with one rank."""
        if self.dense.joinable is None:
            return nullcontext()
        return torch.distributed.algorithms.Join([self.dense.joinable, self.checkpointer])

    def stream_from_loaders(self, *, buffer_size: int, reproducible: bool,
                            embedding_staleness: int) -> Iterator[TrainingBatch]:
        if reproducible and (embedding_staleness != 1 or self.env.world_size != 1):
            raise ValueError(
                "reproducible=True needs embedding_staleness=1 and one NN-worker rank "
                f"(got staleness {embedding_staleness}, {self.env.world_size} ranks): with more, "
                "the order in which updates reach the servers depends on timing")
        source = DataLoaderSource(rank=self.env.rank,
                                  data_loader_addrs=self.env.data_loader_addrs,
                                  common=self.common, reproducible=reproducible)
        stream = BatchStream(source=source, workers=self.workers, staleness=embedding_staleness,
                             buffer_size=buffer_size, reproducible=reproducible,
                             budget=self.budget)
        try:
            # Ranks may receive different numbers of batches: Join lets the ranks that run
            # out shadow the others' collectives, so every batch is trained.
            with self._joined():
                yield from stream
            self.flush()
            if dist.is_initialized():
                # After this, every rank's embedding updates are on the servers.
                with self._naming_peers("the end-of-stream barrier"):
                    dist.barrier()
        finally:
            stream.close()

    def forward(self, batch: TrainingBatch):
        """Forward ``batch``; training batches keep what ``backward`` needs."""
        _check_batch(batch)
        if not batch.requires_grad:
            if batch.batch_id is not None:  # a loader's evaluation batch is done once seen
                self.train_state.new_batch_ids.append(batch.batch_id)
            return super().forward(batch)
        self._sender.raise_if_failed()
        if self._pending is not None:
            raise RuntimeError("forward called twice without backward in between")
        self.reporter.forward_started()
        rows, embeddings = self._embedding_tensors(batch, requires_grad=True)
        dense = [t.to(self.device) for t in batch.non_id_type_features]
        if self.dense.sharded:  # what a rank out of batches replays, with zero gradients
            self._last_inputs = (dense, [e.detach() for e in embeddings])
        # DDP's forward may sync buffers with the other ranks: a collective too.
        with self._autocast(), self._naming_peers("the dense model's forward"):
            self.dense.before_forward()
            output = self.ddp_model(dense, embeddings)
        self._pending = (batch, rows)
        self.staleness = batch.staleness
        self._staleness_sum += batch.staleness
        self._staleness_max = max(self._staleness_max, batch.staleness)
        self._num_steps += 1
        self.train_state.trained(batch.batch_id)
        self.reporter.forward_done()
        return output, [t.to(self.device) for t in batch.labels]

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward, dense optimizer step, and embedding gradients sent to the servers."""
        if self._pending is None:
            raise RuntimeError("backward called without a training forward before it")
        batch, rows = self._pending
        self._pending = None
        started = time.perf_counter()
        try:
            with self._naming_peers("the dense gradients' allreduce"):
                unscale = self._backward_and_step(loss)
        except BaseException:
            batch.release()
            raise
        # An overflowed scaled gradient stays non-finite after unscaling; the embedding
        # worker skips (and counts) it per slot, as the scaler skips the dense step.
        grads = []
        for s, r in zip(batch.slots, rows):
            if r.grad is None:  # the model did not use this slot
                grads.append((s.slot, np.zeros(tuple(r.shape), np.float32)))
                continue
            g = r.grad.detach().float().cpu().numpy()
            grads.append((s.slot, g if unscale is None else g * unscale))
        self._sender.submit(batch, grads)
        self.checkpointer.after_step()
        self.reporter.backward_done(started=started, batch_size=batch.batch_size,
                                    loss=float(loss.detach()), staleness=batch.staleness)
        return loss

    @contextmanager
    def _naming_peers(self, what: str) -> Iterator[None]:
        try:
            with naming_peers(what, self._rank_addresses, self.env.rank, self.common):
                yield
        except PeerFailure:
            self._peer_failed = True
            raise

    def _backward_and_step(self, loss: torch.Tensor) -> float | None:
        """Backward and the dense optimizer step; returns the factor that unscales the
        embedding rows' gradients under AMP (None without a gradient scaler)."""
        if self._scaler is None:
            loss.backward()
            self.dense_optimizer.step()
            unscale = None
        else:
            self._scaler.scale(loss).backward()
            unscale = 1.0 / self._scaler.get_scale()
            self._scaler.step(self.dense_optimizer)
            self._scaler.update()
        self.dense_optimizer.zero_grad(set_to_none=True)
        self.dense.after_step()
        return unscale

    def _shadow_step(self) -> None:
        """A step of a rank out of batches while the others train on (FSDP): its last
        batch again, with a zero loss, so that it takes part in every all-gather and
        reduce-scatter (contributing zero gradients) and steps its optimizer shard."""
        if self._last_inputs is None:
            raise RuntimeError("FSDP: this rank got no batch at all while others train; "
                               "every rank needs at least one")
        dense, embeddings = self._last_inputs
        with self._autocast(), self._naming_peers("the dense model's shadow step"):
            output = self.ddp_model(dense, embeddings)
            outputs = output if isinstance(output, (list, tuple)) else [output]
            self._backward_and_step(sum(o.float().sum() for o in outputs) * 0.0)


def _torchscript(model: torch.nn.Module) -> bytes:
    """``model`` compiled by ``torch.jit.script``, serialized; ValueError if it cannot be."""
    try:
        scripted = torch.jit.script(model)
    except Exception as exc:  # noqa: BLE001 - TorchScript raises many kinds; all mean "cannot"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"with_jit_model=True: torch.jit.script cannot compile the dense model "
            f"{type(model).__name__} ({reason}); make its forward scriptable (type hints, "
            f"no Python-only constructs) or dump without with_jit_model") from exc
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    return buffer.getvalue()

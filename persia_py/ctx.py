"""Contexts of the user's processes (as PERSIA's ``persia.ctx``).

* :class:`TrainCtx` — an NN worker that trains: DDP over the dense tower, embeddings
  looked up ahead within the ``embedding_staleness`` bound, gradients sent back.
* :func:`eval_ctx` / :class:`InferCtx` — forward only; lookups never insert rows.
* :class:`DataCtx` — a data-loader process (see :mod:`persia_py.workers.data_loader`).
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from persia_py.checkpoint import Checkpointer
from persia_py.config import GlobalConfig, load_global_config
from persia_py.data import StreamingDataset
from persia_py.embedding import EmbeddingConfig
from persia_py.embedding.data import PersiaBatch
from persia_py.embedding.optim import Optimizer
from persia_py.env import ENV_EMBEDDING_WORKER_ADDRS, PersiaEnv
from persia_py.progress import StepReporter
from persia_py.workers.budget import ByteBudget
from persia_py.workers.data_loader import DataCtx
from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient
from persia_py.workers.nn_worker import BatchStream, GradientSender, TrainingBatch, pool_slot
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


class EmbeddingCtx:
    """Forward passes with embeddings from the embedding workers (the base of the contexts)."""

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
        """Look up the embeddings of a batch made in this process."""
        if batch.requires_grad:
            raise ValueError("this context only evaluates; build the batch with "
                             "requires_grad=False, or train inside TrainCtx")
        worker = self.workers[next(self._round_robin) % len(self.workers)]
        slots = worker.lookup_direct(batch.id_features(), batch.batch_size)
        return TrainingBatch(
            non_id_type_features=[torch.from_numpy(f.data) for f in batch.non_id_type_features],
            labels=[torch.from_numpy(f.data) for f in batch.labels],
            slots=slots, requires_grad=False, batch_size=batch.batch_size,
            meta=batch.meta or b"",
        )

    def stream(self, dataset: StreamingDataset, *, reproducible: bool,
               embedding_staleness: int) -> Iterator[TrainingBatch]:
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
        if self.model is None:
            raise RuntimeError("this context has no model")
        with torch.no_grad(), self._autocast():
            _, embeddings = self._embedding_tensors(batch, requires_grad=False)
            dense = [t.to(self.device) for t in batch.non_id_type_features]
            output = self.model(dense, embeddings)
        return output, [t.to(self.device) for t in batch.labels]


class InferCtx(EmbeddingCtx):
    """Forward-only context, e.g. for serving: lookups never insert rows."""


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
        embedding_optimizer: :mod:`persia_py.embedding.optim` optimizer, run on the servers.
        dense_optimizer: a ``torch.optim`` optimizer over ``model``'s parameters.
        embedding_config: initialization bounds, weight bound and seed of new rows.
        device_id: CUDA device, or None for CPU.
        mixed_precision: run the model under autocast: float16 with a gradient scaler on
            CUDA, bfloat16 on CPU. Embedding rows stay float32 on the servers.
    """

    def __init__(self, *, model: torch.nn.Module, embedding_optimizer: Optimizer,
                 dense_optimizer: torch.optim.Optimizer,
                 embedding_config: EmbeddingConfig | None = None,
                 device_id: int | None = None, mixed_precision: bool = False,
                 global_config: GlobalConfig | None = None, env: PersiaEnv | None = None) -> None:
        super().__init__(model=model, global_config=global_config, device_id=device_id, env=env)
        if not isinstance(embedding_optimizer, Optimizer):
            raise TypeError("embedding_optimizer must come from persia_py.embedding.optim")
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
        self.budget = ByteBudget(self.global_config.nn_worker_config.max_buffer_bytes,
                                 "nn_worker_config.max_buffer_bytes")
        self.staleness: int = 0
        """Staleness of the batch of the current step (see ``TrainingBatch.staleness``)."""
        self._staleness_sum = 0
        self._staleness_max = 0
        self._num_steps = 0
        self.checkpointer: Checkpointer | None = None
        self.reporter: StepReporter | None = None
        """Progress line, training log and metrics of this rank (see persia_py.progress)."""

    def __enter__(self) -> TrainCtx:
        super().__enter__()
        self.reporter = StepReporter.from_environ(self.env)
        self.model.to(self.device)
        if self.env.world_size > 1:
            if not dist.is_initialized():
                backend = "nccl" if self.device.type == "cuda" else "gloo"
                dist.init_process_group(
                    backend, timeout=timedelta(seconds=self.common.startup_timeout_sec)
                )
                self._owns_process_group = True
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp_model = torch.nn.parallel.DistributedDataParallel(self.model,
                                                                       device_ids=device_ids)
        cfg = self.embedding_config
        request = configure_request(
            self.embedding_optimizer.to_dict(), init_lower=cfg.emb_initialization[0],
            init_upper=cfg.emb_initialization[1], weight_bound=cfg.weight_bound, seed=cfg.seed,
        )
        for w in self.workers:
            w.configure(request)
        self._sender = GradientSender(self.workers, max_in_flight=8)
        self.checkpointer = Checkpointer(self)
        self.checkpointer.resume_if_asked()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._num_steps:
            logger.info("rank %d: %d steps, embedding staleness mean %.2f max %d, peak buffer "
                        "%d bytes", self.env.rank, self._num_steps,
                        self.mean_staleness, self._staleness_max,
                        self.budget.peak)
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
            if self._owns_process_group and dist.is_initialized():
                dist.destroy_process_group()
            super().__exit__(exc_type, exc, tb)

    @property
    def mean_staleness(self) -> float:
        """Mean staleness of the batches trained so far in this context."""
        return self._staleness_sum / self._num_steps if self._num_steps else 0.0

    def flush(self) -> None:
        """Wait until the servers have acknowledged every embedding update sent so far."""
        self._sender.flush(self.common.rpc_timeout_sec)

    def dump_checkpoint(self, dst_dir: str) -> None:
        """Checkpoint embeddings with optimizer state, the dense model and optimizer, and
        the batches trained into ``dst_dir`` (see :mod:`persia_py.checkpoint`); every rank
        calls it at the same step."""
        self.checkpointer.dump(dst_dir)

    def load_checkpoint(self, src_dir: str) -> None:
        """Load a checkpoint written by :meth:`dump_checkpoint` (a root or one folder)."""
        self.checkpointer.load(src_dir)

    def log(self, **values: float) -> None:
        """Record numbers of this step (e.g. ``ctx.log(test_auc=auc)``) in the training log."""
        self.reporter.log(**values)

    def prepare(self, batch: PersiaBatch) -> TrainingBatch:
        if not batch.requires_grad:
            return super().prepare(batch)
        # A training batch made in this process: store its ids like a data loader would.
        index = next(self._round_robin) % len(self.workers)
        ref = self.workers[index].put_batch(batch.id_features(), batch.batch_size, True)
        return TrainingBatch(
            non_id_type_features=[torch.from_numpy(f.data) for f in batch.non_id_type_features],
            labels=[torch.from_numpy(f.data) for f in batch.labels],
            slots=self.workers[index].lookup(ref), requires_grad=True,
            batch_size=batch.batch_size, meta=batch.meta or b"", ref=ref,
            embedding_worker=index,
        )

    def stream(self, dataset: StreamingDataset, *, reproducible: bool,
               embedding_staleness: int) -> Iterator[TrainingBatch]:
        if reproducible and (embedding_staleness != 1 or self.env.world_size != 1):
            raise ValueError(
                "reproducible=True needs embedding_staleness=1 and one NN-worker rank "
                f"(got staleness {embedding_staleness}, {self.env.world_size} ranks): with more, "
                "the order in which updates reach the servers depends on timing")
        stream = BatchStream(
            rank=self.env.rank, data_loader_addrs=self.env.data_loader_addrs,
            workers=self.workers, common=self.common, staleness=embedding_staleness,
            buffer_size=dataset.buffer_size, reproducible=reproducible, budget=self.budget,
        )
        try:
            # Ranks may receive different numbers of batches: Join lets the ranks that run
            # out shadow the others' allreduces, so every batch is trained.
            joined = (torch.distributed.algorithms.Join([self.ddp_model])
                      if self.ddp_model is not self.model else nullcontext())
            with joined:
                yield from stream
            self.flush()
            if dist.is_initialized():
                # After this, every rank's embedding updates are on the servers.
                dist.barrier()
        finally:
            stream.close()

    def forward(self, batch: TrainingBatch):
        """Forward ``batch``; training batches keep what ``backward`` needs."""
        if not batch.requires_grad:
            return super().forward(batch)
        self._sender.raise_if_failed()
        if self._pending is not None:
            raise RuntimeError("forward called twice without backward in between")
        self.reporter.forward_started()
        rows, embeddings = self._embedding_tensors(batch, requires_grad=True)
        dense = [t.to(self.device) for t in batch.non_id_type_features]
        with self._autocast():
            output = self.ddp_model(dense, embeddings)
        self._pending = (batch, rows)
        self.staleness = batch.staleness
        self._staleness_sum += batch.staleness
        self._staleness_max = max(self._staleness_max, batch.staleness)
        self._num_steps += 1
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

"""The base of the persia_py contexts: the active context (:func:`current_ctx`), and
:class:`EmbeddingCtx`, which looks batches' embeddings up through the embedding workers
and runs the model forward, and :func:`eval_ctx` (an evaluation context inside the
current one). :mod:`persia_py.ctx` builds the user's other contexts on it
(:class:`~persia_py.ctx.TrainCtx`, :class:`~persia_py.ctx.InferCtx`) and exports them all."""

from __future__ import annotations

import contextvars
import itertools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from persia_py.config import GlobalConfig, load_global_config
from persia_py.config.checks import check_type
from persia_py.dense.device import device_of_this_process
from persia_py.embedding.data import PersiaBatch
from persia_py.env import ENV_EMBEDDING_WORKER_ADDRS, PersiaEnv
from persia_py.workers.batches import TrainingBatch
from persia_py.workers.budget import ByteBudget
from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient
from persia_py.workers.nn_worker import BatchStream, LocalSource, look_up
from persia_py.workers.pooling import pool_slot

_current: contextvars.ContextVar[EmbeddingCtx | None] = contextvars.ContextVar(
    "persia_py_ctx", default=None
)


def current_ctx(what: str = "this call") -> EmbeddingCtx:
    """The innermost active context; RuntimeError naming ``what`` outside one."""
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError(f"{what} needs an active persia_py context; call it inside "
                           "`with TrainCtx(...) as ctx:`, `with eval_ctx(model) as ctx:` or "
                           "`with InferCtx(...) as ctx:`")
    return ctx


def check_addresses(where: str, addresses: object) -> None:
    """TypeError unless ``addresses`` is None or a list (tuple) of ``host:port`` strings.
    A single string is refused: iterated, it would be taken as one address per character."""
    check_type(where, addresses, (list, tuple),
               "a list of 'host:port' addresses, e.g. ['host:port'], or None", optional=True)
    for i, address in enumerate(addresses if isinstance(addresses, (list, tuple)) else ()):
        check_type(f"{where}[{i}]", address, str, "a 'host:port' address, a str")


def check_looked_up(batch: object) -> None:
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
    _usage = "eval_ctx(model)"
    """How the user opens this context, for messages."""

    def __init__(self, *, model: torch.nn.Module | None = None,
                 embedding_worker_addresses: list[str] | None = None,
                 global_config: GlobalConfig | None = None, device_id: int | None = None,
                 env: PersiaEnv | None = None) -> None:
        name = type(self).__name__
        check_type(f"{name}(model=...)", model, torch.nn.Module,
                   "a torch.nn.Module (the dense tower)", optional=True)
        check_type(f"{name}(device_id=...)", device_id, int,
                   "an int (a CUDA device index) or None", optional=True)
        check_addresses(f"{name}(embedding_worker_addresses=...)", embedding_worker_addresses)
        check_type(f"{name}(global_config=...)", global_config, GlobalConfig,
                   "a persia_py.config.GlobalConfig (e.g. load_global_config(path)) or None",
                   optional=True)
        check_type(f"{name}(env=...)", env, PersiaEnv,
                   "a persia_py.env.PersiaEnv or None (read from the environment)",
                   optional=True)
        # `is None`, not `or`: a value given is used or refused, never silently replaced.
        self.env = env if env is not None else PersiaEnv.from_environ()
        self.global_config = (global_config if global_config is not None
                              else load_global_config(self.env.global_config))
        self.common = self.global_config.common_config
        self.model = model
        self.device = device_of_this_process(device_id, self.env.local_rank)
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

    def _require_active(self, what: str) -> None:
        """RuntimeError unless this context is open (entered, not yet exited): outside
        it there are no connections to the embedding workers."""
        if self._token is None:
            raise RuntimeError(f"{what} is used outside its context; use it inside "
                               f"`with {self._usage} as ctx:`")

    # -- batches -----------------------------------------------------------------------

    def prepare(self, batch: PersiaBatch) -> TrainingBatch:
        """Look up the embeddings of one evaluation batch made in this process (e.g. a
        serving request); no rows are inserted. A dataset of batches goes through
        :class:`persia_py.data.DataLoader`, which looks ahead."""
        check_type("ctx.prepare(batch)", batch, PersiaBatch,
                   "a persia_py.embedding.data.PersiaBatch")
        self._require_active("ctx.prepare")
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
        raise RuntimeError("a StreamingDataset is the training stream; iterate "
                           "DataLoader(StreamingDataset(...)) inside `with TrainCtx(...) as "
                           "ctx:`, and evaluate on an IterableDataset of batches built with "
                           "requires_grad=False")

    def _embedding_tensors(self, batch: TrainingBatch, requires_grad: bool):
        rows = [self._rows_tensor(s.rows).requires_grad_(requires_grad) for s in batch.slots]
        return rows, [pool_slot(r, s) for r, s in zip(rows, batch.slots)]

    def _rows_tensor(self, rows: np.ndarray) -> torch.Tensor:
        """A slot's rows on the context's device: float16 rows (those the CPU pools as they
        are, :func:`persia_py.workers.slots.pooled_by_kernel`) are widened on an
        accelerator, after the copy (half the bytes), and trained there in float32."""
        tensor = torch.from_numpy(rows).to(self.device)
        if tensor.dtype == torch.float16 and tensor.device.type != "cpu":
            tensor = tensor.float()
        return tensor

    def _autocast(self):
        if not self.mixed_precision:
            return nullcontext()
        dtype = torch.float16 if self.device.type == "cuda" else torch.bfloat16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def forward(self, batch: TrainingBatch, *, model: torch.nn.Module | None = None):
        """Run the model on ``batch``; returns ``(output, labels)`` (as PERSIA). ``model``:
        run this one instead of the context's (a serving process that swaps in new
        dense versions passes the one it read for this request)."""
        check_looked_up(batch)
        self._require_active("ctx.forward")
        model = self.model if model is None else model
        if model is None:
            raise RuntimeError("this context has no model")
        with torch.no_grad(), self._autocast():
            _, embeddings = self._embedding_tensors(batch, requires_grad=False)
            dense = [t.to(self.device) for t in batch.non_id_type_features]
            output = model(dense, embeddings)
        return output, [t.to(self.device) for t in batch.labels]


@contextmanager
def eval_ctx(model: torch.nn.Module) -> Iterator[EmbeddingCtx]:
    """Evaluate ``model`` inside the current context, sharing its connections."""
    check_type("eval_ctx(model=...)", model, torch.nn.Module,
               "a torch.nn.Module (the dense tower)")
    outer = current_ctx("eval_ctx(model)")
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
        ctx._token = None  # the context is closed: using it now is an error


__all__ = ["EmbeddingCtx", "check_addresses", "check_looked_up", "current_ctx", "eval_ctx"]

"""The NN-worker runtime under :class:`persia_py.ctx.TrainCtx`: batches in, gradients out.

* :class:`BatchStream` pulls batches from every data loader (one thread each), looks up
  their embeddings ahead of the training step, and bounds how far ahead it runs with
  the ``embedding_staleness`` semaphore: taken before a lookup, released when the
  parameter servers have acknowledged that batch's embedding update. A byte budget
  bounds the memory held by looked-up batches and their not-yet-acknowledged gradients.
* :class:`GradientSender` sends a step's embedding gradients in the background and
  surfaces any failure at the next call instead of losing it.
* :func:`pool_slot` turns a slot's distinct rows into the tensor the model sees
  (sum / mean / raw sequence) with one vectorized op, so backward gives one gradient
  per distinct id.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch
import torch.nn.functional as F

from persia_py.config import CommonConfig
from persia_py.embedding.data import PersiaBatch
from persia_py.proto import data_loader_pb2 as pb
from persia_py.proto import data_loader_pb2_grpc
from persia_py.wire import codec
from persia_py.wire.rpc import OutageLog, call, create_channel, wait_for_ready
from persia_py.workers.budget import ByteBudget
from persia_py.workers.embedding_worker import SlotRows
from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient

logger = logging.getLogger(__name__)


def pool_slot(rows: torch.Tensor, slot: SlotRows) -> torch.Tensor:
    """The model-facing tensor of one slot: ``[batch, dim]`` pooled or ``[batch, L, dim]`` raw.

    A hash-stacked id has ``hash_stack_rounds`` consecutive index entries whose rows are
    summed into its embedding; pooling, ``sqrt_scaling`` and raw positions count ids.
    """
    lengths = torch.from_numpy(slot.lengths.astype(np.int64))
    index = torch.from_numpy(slot.index)
    batch_size = lengths.numel()
    rounds = slot.hash_stack_rounds
    entries = lengths * rounds  # index entries per sample
    if slot.pooling == "raw":
        fixed = slot.sample_fixed_size
        sample = torch.repeat_interleave(torch.arange(batch_size), entries)
        starts = torch.cumsum(entries, 0) - entries
        position = torch.div(torch.arange(index.numel()) - starts[sample], rounds,
                             rounding_mode="floor")
        flat = rows.new_zeros(batch_size * fixed, rows.shape[1])
        flat = flat.index_add(0, sample * fixed + position, rows[index])
        return flat.view(batch_size, fixed, rows.shape[1])
    if rounds == 1 and index.numel() == batch_size and bool((lengths == 1).all()):
        # One id per sample: sum, mean and sqrt scaling all give its row, and
        # index_select's backward (one index_add) is cheaper than embedding_bag's.
        return rows.index_select(0, index)
    offsets = torch.cumsum(entries, 0) - entries
    mode = slot.pooling
    bag = (_Bag.apply if index.numel() > _NATIVE_BACKWARD_MAX_ENTRIES * max(batch_size, 1)
           else _native_bag)
    if not slot.sqrt_scaling and (mode == "sum" or rounds == 1):
        return bag(rows, index, offsets, entries, mode, None)
    # A per-entry weight of the sample: 1/sqrt(n) for sqrt_scaling, 1/n for mean.
    count = lengths.clamp(min=1).to(rows.dtype)
    scale = count.rsqrt() if slot.sqrt_scaling else torch.ones_like(count)
    if mode == "mean":
        scale = scale / count
    weights = torch.repeat_interleave(scale, entries)
    return bag(rows, index, offsets, entries, "sum", weights)


_NATIVE_BACKWARD_MAX_ENTRIES = 4
"""Up to this many index entries per sample, pooling keeps torch's own backward: with
few entries :class:`_Bag`'s gain is small, and its backward runs Python code that must
win the GIL from the worker's lookup and gradient threads, which costs more than it
saves (docs/benchmarks.md)."""


def _native_bag(rows, index, offsets, entries, mode, weights):
    return F.embedding_bag(index, rows, offsets, mode=mode, per_sample_weights=weights)


class _Bag(torch.autograd.Function):
    """``F.embedding_bag`` whose backward scatters each entry's gradient onto its row with
    one ``index_add_``: the built-in dense backward sorts the index and adds row by row,
    several times slower with many entries per sample (docs/benchmarks.md)."""

    @staticmethod
    def forward(ctx, rows, index, offsets, entries, mode, weights):
        ctx.save_for_backward(index, entries, weights)
        ctx.mode, ctx.num_rows = mode, rows.shape[0]
        return F.embedding_bag(index, rows, offsets, mode=mode, per_sample_weights=weights)

    @staticmethod
    def backward(ctx, grad):
        index, entries, weights = ctx.saved_tensors
        sample = torch.repeat_interleave(torch.arange(entries.numel()), entries)
        per_entry = grad.index_select(0, sample)  # each entry gets its sample's gradient
        if weights is not None:
            per_entry = per_entry * weights.unsqueeze(1)
        elif ctx.mode == "mean":
            per_entry = per_entry / entries.clamp(min=1).to(grad.dtype)[sample].unsqueeze(1)
        rows_grad = per_entry.new_zeros(ctx.num_rows, per_entry.shape[1])
        return rows_grad.index_add_(0, index, per_entry), None, None, None, None, None


@dataclass
class TrainingBatch:
    """A batch ready for ``ctx.forward``: embeddings looked up, tensors built."""

    non_id_type_features: list[torch.Tensor]
    labels: list[torch.Tensor]
    slots: list[SlotRows]
    requires_grad: bool
    batch_size: int
    meta: bytes = b""
    ref: int = 0
    embedding_worker: int = 0
    batch_id: int | None = None
    """The data loader's id of this batch (see persia_py.ids.positions); None when the
    batch was made in this process."""
    staleness: int = 0
    """Batches of this NN worker whose embedding updates were not yet applied when this
    batch's embeddings were looked up."""
    release: Callable[[], None] = field(default=lambda: None)
    """Called once the batch's gradients are acknowledged (or at once without grads)."""
    loader: LoaderLink | None = None
    """The data loader that made it (which keeps its ID features until told it is done)."""

    @property
    def nbytes(self) -> int:
        """Bytes this batch holds now plus the gradients it will produce."""
        rows = sum(s.rows.nbytes for s in self.slots)
        other = sum(s.index.nbytes + s.lengths.nbytes for s in self.slots)
        dense = sum(t.numel() * t.element_size()
                    for t in [*self.non_id_type_features, *self.labels])
        return 2 * rows + other + dense


def tensors_from_named(named) -> list[torch.Tensor]:
    return [torch.from_numpy(codec.decode(n.tensor, name=n.name)) for n in named]


ONLY_EVALUATES = ("this context only evaluates; build the batch with requires_grad=False, "
                  "or train inside TrainCtx")


class LoaderLink:
    """An NN worker's side of one data loader: the batch ids it finished training, told to
    the loader with its next NextBatch (the loader then forgets their ID features), and
    a way to have a batch put on its embedding worker again when that worker restarted
    and lost it (see kept_batches.KeptBatches)."""

    def __init__(self, stub, address: str, common: CommonConfig, outages: OutageLog) -> None:
        self.stub, self.address = stub, address
        self._common, self._outages = common, outages
        self._done: list[int] = []
        self._in_training: set[int] = set()  # batches handed to this worker, not finished
        self._changed = threading.Condition()

    def handed(self, batch_id: int) -> None:
        with self._changed:
            self._in_training.add(batch_id)

    def finished(self, batch_id: int) -> None:
        """The batch's training is over (its update acknowledged, or none was due)."""
        with self._changed:
            self._done.append(batch_id)
            self._in_training.discard(batch_id)
            self._changed.notify_all()

    def _wait_settled(self, timeout: float) -> bool:
        """Whether every batch handed over is finished (waits up to ``timeout``)."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._in_training, timeout)

    def settle(self, stop: threading.Event) -> None:
        """After the end of this loader's stream: tell it which batches finished, until
        none it handed over is in training (it keeps them for a resend until then)."""
        while not stop.is_set():
            settled = self._wait_settled(0.5)
            # Retried while the loader restarts: it keeps what it has not been told.
            if not self._tell(self.take_done(), retry=True) or settled:
                return

    def abandon(self) -> None:
        """Tell the loader it may forget every batch handed over, finished or not (the
        stream is closing: nothing will ask for them again)."""
        with self._changed:
            done = self._done + sorted(self._in_training)
            self._done, self._in_training = [], set()
        self._tell(done)

    def _tell(self, done: list[int], retry: bool = False) -> bool:
        """Send ``done`` alone (a request that takes no batch; telling twice is harmless),
        with ``retry`` until ``rpc_timeout_sec`` passed. Best effort: a loader that
        stopped waiting forgets them anyway. False if the loader did not answer."""
        if not done:
            return True
        request = pb.NextBatchRequest(done=done, only_done=True)
        try:
            if retry:
                call(self.stub.NextBatch, request, timeout=self._common.rpc_timeout_sec,
                     idempotent=True, what=f"data loader {self.address}",
                     outages=self._outages)
            else:
                self.stub.NextBatch(request, timeout=5.0)
        except grpc.RpcError as exc:
            logger.info("data loader %s: finished batches not told (%s)", self.address,
                        exc.code().name)
            return False
        return True

    def take_done(self) -> list[int]:
        with self._changed:
            done, self._done = self._done, []
        return done

    def resend(self, batch_id: int, num_workers: int) -> tuple[int, int]:
        """(embedding worker index, new ref) of ``batch_id`` put again by its loader."""
        logger.warning("batch %d is gone from its embedding worker (restarted); asking data "
                       "loader %s to put it there again", batch_id, self.address)
        # Safe to retry: a repeated put of a pending batch answers the same ref.
        answer = call(self.stub.ResendBatch, pb.ResendBatchRequest(batch_id=batch_id),
                      timeout=self._common.rpc_timeout_sec, idempotent=True,
                      what=f"data loader {self.address}", outages=self._outages)
        if not 0 <= answer.embedding_worker < num_workers:
            raise ValueError(f"data loader {self.address} put batch {batch_id} on embedding "
                             f"worker {answer.embedding_worker}, only {num_workers} known")
        return answer.embedding_worker, answer.ref


@dataclass
class LoaderBatch:
    """A batch as a data loader answered it, and that loader."""

    batch: pb.Batch
    loader: LoaderLink


def _gone(exc: BaseException) -> bool:
    """Whether an embedding worker answered that it does not hold the ref (it restarted)."""
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.NOT_FOUND


def look_up(item: PersiaBatch | LoaderBatch, workers: Sequence[EmbeddingWorkerClient], *,
            next_worker: int, training: bool, staleness: int = 0) -> TrainingBatch:
    """The one place a :class:`TrainingBatch` is made: its embeddings looked up.

    ``item`` is a batch from a data loader (its ids already wait on the embedding worker
    it names) or a :class:`PersiaBatch` made in this process: a training one has its ids
    stored on ``workers[next_worker]`` first, as a data loader would; an evaluation one
    is looked up directly, inserting no rows. ``training=False`` refuses training batches.
    A loader's batch whose embedding worker restarted (and lost its ids) is put there
    again by the loader and looked up under its new ref.
    """
    loader = None
    if isinstance(item, LoaderBatch):
        item, loader = item.batch, item.loader
    if item.requires_grad and not training:
        raise ValueError(ONLY_EVALUATES)
    if isinstance(item, PersiaBatch):
        index, worker = next_worker, workers[next_worker]
        features = item.id_features()
        ref = worker.put_batch(features, item.batch_size, True) if item.requires_grad else 0
        slots = (worker.lookup(ref) if item.requires_grad
                 else worker.lookup_direct(features, item.batch_size))
        dense = [torch.from_numpy(f.data) for f in item.non_id_type_features]
        labels = [torch.from_numpy(f.data) for f in item.labels]
        meta, batch_id = item.meta or b"", None
    else:
        index, ref = item.embedding_worker, item.ref
        if not 0 <= index < len(workers):
            raise ValueError(f"batch {item.batch_id} names embedding worker {index}, only "
                             f"{len(workers)} known")
        try:
            slots = workers[index].lookup(ref)
        except grpc.RpcError as exc:
            if loader is None or not _gone(exc):
                raise
            index, ref = loader.resend(item.batch_id, len(workers))
            slots = workers[index].lookup(ref)
        dense = tensors_from_named(item.non_id_features)
        labels = tensors_from_named(item.labels)
        meta, batch_id = item.meta, item.batch_id
    return TrainingBatch(non_id_type_features=dense, labels=labels, slots=slots,
                         requires_grad=item.requires_grad, batch_size=item.batch_size,
                         meta=meta, ref=ref, embedding_worker=index, staleness=staleness,
                         batch_id=batch_id, loader=loader)


class GradientSender:
    """Sends embedding gradients in the background; the first failure is raised on the next call."""

    def __init__(self, workers: list[EmbeddingWorkerClient], max_in_flight: int) -> None:
        self._workers = workers
        self._pool = ThreadPoolExecutor(max_workers=max(1, max_in_flight),
                                        thread_name_prefix="grad-send")
        self._futures: set[Future] = set()
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def submit(self, batch: TrainingBatch, grads: list[tuple[str, np.ndarray]]) -> None:
        self.raise_if_failed()
        future = self._pool.submit(self._send, batch, grads)
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._done)

    def _send(self, batch: TrainingBatch, grads: list[tuple[str, np.ndarray]]) -> None:
        try:
            try:
                self._workers[batch.embedding_worker].update_gradients(batch.ref, grads)
            except grpc.RpcError as exc:
                if batch.loader is None or not _gone(exc):
                    raise
                # Its worker restarted after the lookup: routed again from the loader's
                # copy; replicas that applied it before acknowledge it only.
                index, ref = batch.loader.resend(batch.batch_id, len(self._workers))
                self._workers[index].update_gradients(ref, grads, rerouted=True)
        finally:
            batch.release()

    def _done(self, future: Future) -> None:
        with self._lock:
            self._futures.discard(future)
            if future.exception() is not None and self._error is None:
                self._error = future.exception()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"sending embedding gradients failed: {self._error}") from self._error

    def flush(self, timeout: float) -> None:
        """Wait until every submitted update is acknowledged."""
        with self._lock:
            pending = list(self._futures)
        for f in pending:
            f.exception(timeout=timeout)
        self.raise_if_failed()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


_END = object()

_LOOKUP_THREADS = 2
"""Lookups in flight at once (at most ``embedding_staleness``)."""

Put = Callable[[object], bool]
"""Hands one batch to the stream; False once the stream is closing."""
Producer = Callable[[Put, threading.Event], None]
"""Puts batches until its source ends or the event (the stream closing) is set."""


class DataLoaderSource:
    """Batches pulled from the data-loader processes: one producer per loader, or one for
    all visiting them in a fixed order when ``reproducible`` (so the batch order depends
    only on what the loaders send)."""

    def __init__(self, *, rank: int, data_loader_addrs: Sequence[str], common: CommonConfig,
                 reproducible: bool) -> None:
        if not data_loader_addrs:
            raise RuntimeError("no data loader addresses (PERSIA_DATA_LOADER_ADDRS is empty)")
        self.rank = rank
        self.common = common
        self._channels = [create_channel(a, common) for a in data_loader_addrs]
        for channel, address in zip(self._channels, data_loader_addrs):
            wait_for_ready(channel, address, common.startup_timeout_sec)
        self._outages = OutageLog()
        loaders = [LoaderLink(data_loader_pb2_grpc.DataLoaderStub(c), a, common, self._outages)
                   for c, a in zip(self._channels, data_loader_addrs)]
        self._groups = [loaders] if reproducible else [[loader] for loader in loaders]

    def producers(self) -> list[Producer]:
        return [functools.partial(self._fetch, group) for group in self._groups]

    def _fetch(self, loaders: list, put: Put, stop: threading.Event) -> None:
        active = list(loaders)
        # NextBatch is idempotent per (consumer, request_seq): a retry after a lost reply
        # gets the same batch again (see data_loader.BatchQueue).
        consumer = secrets.token_bytes(16)
        request_seq = itertools.count()
        while active and not stop.is_set():
            for loader in list(active):
                request = pb.NextBatchRequest(rank=self.rank, consumer=consumer,
                                              request_seq=next(request_seq),
                                              done=loader.take_done())
                response = call(loader.stub.NextBatch, request,
                                timeout=self.common.rpc_timeout_sec, idempotent=True,
                                what=f"data loader {loader.address}", outages=self._outages)
                if response.end_of_stream:
                    active.remove(loader)
                elif response.has_batch:
                    loader.handed(response.batch.batch_id)
                    if not put(LoaderBatch(response.batch, loader)):
                        return
        for loader in loaders:
            loader.settle(stop)

    def close(self) -> None:
        for group in self._groups:
            for loader in group:
                loader.abandon()
        for c in self._channels:
            c.close()


class LocalSource:
    """Batches made in this process (a user's ``IterableDataset``), read by one thread
    ahead of training as PERSIA did, so their lookups overlap the training step."""

    def __init__(self, batches: Iterable[PersiaBatch]) -> None:
        self._batches = batches

    def producers(self) -> list[Producer]:
        return [self._produce]

    def _produce(self, put: Put, stop: threading.Event) -> None:
        for i, batch in enumerate(self._batches):
            if not isinstance(batch, PersiaBatch):
                raise TypeError(f"the dataset yielded {type(batch).__name__} as batch {i}; "
                                "an IterableDataset yields persia_py.embedding.data.PersiaBatch")
            if not put(batch):
                return

    def close(self) -> None:
        pass


class BatchStream:
    """Batches with embeddings looked up ahead of use, from a :class:`DataLoaderSource`
    or a :class:`LocalSource`: the same staleness bound and byte budget for both."""

    def __init__(
        self,
        *,
        source: DataLoaderSource | LocalSource,
        workers: list[EmbeddingWorkerClient],
        staleness: int,
        buffer_size: int,
        reproducible: bool,
        budget: ByteBudget,
        training: bool = True,
    ) -> None:
        if staleness < 1:
            raise ValueError(f"embedding_staleness must be >= 1, got {staleness}")
        self.source = source
        self.workers = workers
        self.training = training
        self.staleness = threading.BoundedSemaphore(staleness)
        self.budget = budget
        self._round_robin = itertools.count()
        self._outstanding = 0  # batches looked up whose updates are not acknowledged
        self._outstanding_lock = threading.Lock()
        self._raw: queue.Queue = queue.Queue(maxsize=max(1, buffer_size))
        self._ready: queue.Queue = queue.Queue(maxsize=max(1, staleness))
        self._stop = threading.Event()
        producers = source.producers()
        self._threads = [threading.Thread(target=self._guard, args=(self._produce, p),
                                          name=f"fetch-{i}", daemon=True)
                         for i, p in enumerate(producers)]
        self._fetchers_left = len(self._threads)
        # Reproducible: one lookup at a time, in arrival order. Otherwise several, so that
        # one batch's dedup, parameter-server reads and decoding overlap another's (the
        # staleness semaphore still bounds how many are looked up ahead).
        self._lookups_left = 1 if reproducible else min(staleness, _LOOKUP_THREADS)
        self._threads += [threading.Thread(target=self._lookup,
                                           name=f"lookup-{i}", daemon=True)
                          for i in range(self._lookups_left)]
        for t in self._threads:
            t.start()

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the training loop below
            logger.exception("batch pipeline thread failed")
            self._put(self._ready, exc)

    def _put(self, q: queue.Queue, item) -> bool:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, producer: Producer) -> None:
        producer(lambda batch: self._put(self._raw, batch), self._stop)
        # Only a producer that ended well counts as done: a failed one's error must reach
        # the training loop before the end of the stream does.
        with self._outstanding_lock:
            self._fetchers_left -= 1

    def _next_raw(self):
        """The next fetched batch, or None once every fetcher has ended and all are taken."""
        while not self._stop.is_set():
            try:
                return self._raw.get(timeout=0.2)
            except queue.Empty:
                if self._fetchers_left == 0:  # a fetcher puts its last batch before it ends
                    try:
                        return self._raw.get_nowait()
                    except queue.Empty:
                        return None
        return None

    def _lookup(self) -> None:
        failed = False
        try:
            while (item := self._next_raw()) is not None:
                while not self.staleness.acquire(timeout=0.2):
                    if self._stop.is_set():
                        return
                with self._outstanding_lock:
                    self._outstanding += 1
                    staleness = self._outstanding - 1
                try:
                    batch = self._to_training_batch(item, staleness)
                except BaseException:
                    self._release_slot()
                    raise
                if batch is None:
                    self._release_slot()
                    return
                if not self._put(self._ready, batch):
                    batch.release()  # closing: give back its budget and staleness slot
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the training loop
            failed = True
            logger.exception("batch lookup thread failed")
            self._put(self._ready, exc)  # before this thread counts as done: never after _END
        finally:
            with self._outstanding_lock:
                self._lookups_left -= 1
                last = self._lookups_left == 0 and not failed
        if last:
            self._put(self._ready, _END)

    def _release_slot(self) -> None:
        with self._outstanding_lock:
            self._outstanding -= 1
        self.staleness.release()

    def _to_training_batch(self, item: PersiaBatch | LoaderBatch,
                           staleness: int) -> TrainingBatch | None:
        batch = look_up(item, self.workers, training=self.training, staleness=staleness,
                        next_worker=next(self._round_robin) % len(self.workers))
        loader, id_ = batch.loader, batch.batch_id
        if not batch.requires_grad:
            self._release_slot()
            if loader is not None:
                loader.finished(id_)
            return batch
        # Room for the batch and its future gradients, held until the update is acknowledged.
        num_bytes = batch.nbytes
        if not self.budget.acquire(num_bytes, self._stop):
            return None  # the stream is closing; the caller gives back the slot

        def release() -> None:
            self.budget.release(num_bytes)
            self._release_slot()
            if loader is not None:
                loader.finished(id_)

        batch.release = release
        return batch

    def __iter__(self) -> Iterator[TrainingBatch]:
        return self.batches()

    def batches(self, interrupted: Callable[[], bool] | None = None) -> Iterator[TrainingBatch]:
        """The batches, in order; with ``interrupted``, ends early once it is true while
        no batch is ready (an online job asked to stop while its stream is idle)."""
        while True:
            try:
                item = self._ready.get(timeout=None if interrupted is None else 0.2)
            except queue.Empty:
                if interrupted():
                    return
                continue
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise RuntimeError(f"batch pipeline failed: {item}") from item
            yield item

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10.0)
        self.source.close()
        # Batches looked up but never handed out (the loop stopped early) give back their
        # bytes: the budget belongs to the context and outlives this stream.
        while True:
            try:
                item = self._ready.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, TrainingBatch):
                item.release()


"""The NN-worker runtime under :class:`persia_py.ctx.TrainCtx`: batches in, gradients out.

* :class:`BatchStream` pulls batches from every data loader (one thread each), looks up
  their embeddings ahead of the training step, and bounds how far ahead it runs with
  the ``embedding_staleness`` semaphore: taken before a lookup, released when the
  parameter servers have acknowledged that batch's embedding update. A byte budget
  bounds the memory held by looked-up batches and their not-yet-acknowledged gradients.
* :func:`look_up` makes a :class:`~persia_py.workers.batches.TrainingBatch` of a batch:
  its embeddings looked up through the embedding worker that holds its ids.

Beside it: :mod:`persia_py.workers.gradient_sender` sends a step's embedding gradients in
the background, and :mod:`persia_py.workers.pooling` turns a slot's distinct rows into the
tensor the model sees.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

import grpc
import torch

from persia_py.config import CommonConfig
from persia_py.embedding.data import PersiaBatch
from persia_py.proto import data_loader_pb2 as pb
from persia_py.proto import data_loader_pb2_grpc
from persia_py.wire import codec
from persia_py.wire.rpc import OutageLog, call, create_channel, wait_for_ready
from persia_py.workers.batches import LoaderBatch, LoaderLink, TrainingBatch, ref_gone
from persia_py.workers.budget import ByteBudget
from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient

logger = logging.getLogger(__name__)


def tensors_from_named(named) -> list[torch.Tensor]:
    return [torch.from_numpy(codec.decode(n.tensor, name=n.name)) for n in named]


ONLY_EVALUATES = ("this context only evaluates; build the batch with requires_grad=False, "
                  "or train inside TrainCtx")


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
    batch: PersiaBatch | pb.Batch = item.batch if isinstance(item, LoaderBatch) else item
    loader = item.loader if isinstance(item, LoaderBatch) else None
    if batch.requires_grad and not training:
        raise ValueError(ONLY_EVALUATES)
    if isinstance(batch, PersiaBatch):
        index, worker = next_worker, workers[next_worker]
        features = batch.id_features()
        ref = worker.put_batch(features, batch.batch_size, True) if batch.requires_grad else 0
        slots = (worker.lookup(ref) if batch.requires_grad
                 else worker.lookup_direct(features, batch.batch_size))
        dense = [torch.from_numpy(f.data) for f in batch.non_id_type_features]
        labels = [torch.from_numpy(f.data) for f in batch.labels]
        meta, batch_id = batch.meta or b"", None
    else:
        index, ref = batch.embedding_worker, batch.ref
        if not 0 <= index < len(workers):
            raise ValueError(f"batch {batch.batch_id} names embedding worker {index}, only "
                             f"{len(workers)} known")
        try:
            slots = workers[index].lookup(ref)
        except grpc.RpcError as exc:
            if loader is None or not ref_gone(exc):
                raise
            index, ref = loader.resend(batch.batch_id, len(workers))
            slots = workers[index].lookup(ref)
        dense = tensors_from_named(batch.non_id_features)
        labels = tensors_from_named(batch.labels)
        meta, batch_id = batch.meta, batch.batch_id
    return TrainingBatch(non_id_type_features=dense, labels=labels, slots=slots,
                         requires_grad=batch.requires_grad, batch_size=batch.batch_size,
                         meta=meta, ref=ref, embedding_worker=index, staleness=staleness,
                         batch_id=batch_id, loader=loader)


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
        # gets the same batch again (see loader_service.BatchQueue).
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
            if loader is not None and id_ is not None:
                loader.finished(id_)
            return batch
        # Room for the batch and its future gradients, held until the update is acknowledged.
        num_bytes = batch.nbytes
        if not self.budget.acquire(num_bytes, self._stop):
            return None  # the stream is closing; the caller gives back the slot

        def release() -> None:
            self.budget.release(num_bytes)
            self._release_slot()
            if loader is not None and id_ is not None:
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
            except queue.Empty:  # only with a timeout, so with ``interrupted``
                if interrupted is not None and interrupted():
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


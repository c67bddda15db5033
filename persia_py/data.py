"""Datasets and the DataLoader of an NN worker (as PERSIA's ``persia.data``).

* :class:`StreamingDataset`: the batches that data-loader processes send.
* :class:`IterableDataset`: batches made in this process (e.g. a test set); subclass it
  and yield :class:`~persia_py.embedding.data.PersiaBatch` from ``__iter__``.

:class:`DataLoader` turns either into batches whose embeddings are looked up, ready for
``ctx.forward``. It belongs to the enclosing ``TrainCtx`` / ``eval_ctx`` / ``InferCtx``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from persia_py.config.checks import check_type
from persia_py.ctx import current_ctx
from persia_py.embedding.data import PersiaBatch
from persia_py.workers.batches import TrainingBatch

__all__ = ["DataLoader", "IterableDataset", "StreamingDataset"]


class IterableDataset:
    """Base of datasets made in the NN-worker process; subclasses implement ``__iter__``.

    A :class:`DataLoader` reads it in a background thread, ``buffer_size`` batches ahead,
    and looks up their embeddings within the same staleness bound and byte budget as
    the data loaders' batches.
    """

    def __init__(self, buffer_size: int = 10) -> None:
        check_type(f"{type(self).__name__}(buffer_size=...)", buffer_size, int,
                   "an int >= 1 (batches read ahead)")
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        self.buffer_size = buffer_size

    def __iter__(self) -> Iterator[PersiaBatch]:
        raise NotImplementedError


class StreamingDataset(IterableDataset):
    """The stream of batches the data loaders send to this job, for training: iterate
    ``DataLoader(StreamingDataset(...))`` inside ``with TrainCtx(...)``."""

    def __iter__(self) -> Iterator[PersiaBatch]:
        raise TypeError("a StreamingDataset is not iterated directly; iterate "
                        "DataLoader(StreamingDataset(...)) inside `with TrainCtx(...) as ctx:`")


class DataLoader:
    """Batches with their embeddings looked up, for the current context.

    Args:
        dataset: a :class:`StreamingDataset` or an :class:`IterableDataset`.
        reproducible: visit data loaders in a fixed order, so that with one NN worker and
            ``embedding_staleness=1`` the batch order, and so the run, is reproducible.
        embedding_staleness: most batches of this NN worker looked up but whose
            embedding updates are not yet acknowledged (default 1: synchronous).
    """

    def __init__(self, dataset: IterableDataset, *, reproducible: bool = False,
                 embedding_staleness: int | None = None) -> None:
        check_type("DataLoader(dataset=...)", dataset, IterableDataset,
                   "a persia_py.data.StreamingDataset, or a subclass of "
                   "persia_py.data.IterableDataset that yields PersiaBatch")
        check_type("DataLoader(reproducible=...)", reproducible, bool, "a bool")
        check_type("DataLoader(embedding_staleness=...)", embedding_staleness, int,
                   "an int >= 1 or None", optional=True)
        self.ctx = current_ctx("DataLoader(...)")
        self.dataset = dataset
        self.reproducible = reproducible
        self.embedding_staleness = 1 if embedding_staleness is None else embedding_staleness
        if self.embedding_staleness < 1:
            raise ValueError(f"embedding_staleness must be >= 1, got {embedding_staleness}")

    def __iter__(self) -> Iterator[TrainingBatch]:
        self.ctx._require_active("a DataLoader")
        options: dict[str, Any] = dict(
            buffer_size=self.dataset.buffer_size, reproducible=self.reproducible,
            embedding_staleness=self.embedding_staleness)
        if isinstance(self.dataset, StreamingDataset):
            return self.ctx.stream_from_loaders(**options)
        return self.ctx.stream_local(self.dataset, **options)

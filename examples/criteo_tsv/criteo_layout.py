"""Criteo's TSV layout for the CSV reader, and records to ``PersiaBatch``es.

Label, 13 integer columns (``I1``..``I13``, empty: 0) and 26 hex categorical columns
(``C1``..``C26``), each hashed to a stable id by the reader (``kind="category"``, salted by
the column's name). Shared by the data loader (training file, its share) and the NN
workers (test file, a share per rank).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from persia_py.data import IterableDataset
from persia_py.data_readers import CsvColumn, CsvReader, CsvReaderConfig
from persia_py.embedding.data import IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch
from persia_py.reader_share import ReaderShare

INT_COLUMNS = [f"I{i + 1}" for i in range(13)]
CAT_COLUMNS = [f"C{i + 1}" for i in range(26)]
CONFIG = CsvReaderConfig(
    columns=(CsvColumn(name="label", kind="float"),
             *(CsvColumn(name=n, kind="int", default=0) for n in INT_COLUMNS),
             *(CsvColumn(name=n, kind="category") for n in CAT_COLUMNS)),
    delimiter="\t",
)


def read_batches(path: str, batch_size: int, *, requires_grad: bool = True,
                 share: ReaderShare | None = None) -> Iterator[PersiaBatch]:
    """``PersiaBatch``es of the file's records; in a data loader, of its share only (the
    reader's default). Each batch's ``meta`` holds its records' line numbers (int64): the
    rows' ids, for the NN worker to report what it trained."""
    for batch in CsvReader(path, CONFIG, share=share).batches(batch_size):
        counts = np.stack([batch.values[n] for n in INT_COLUMNS], axis=1)
        # Counts are heavy-tailed (negative ones occur in Criteo): log of the positive part.
        dense = np.log1p(np.maximum(counts, 0)).astype(np.float32)
        yield PersiaBatch(
            [IDTypeFeatureWithSingleID(n, batch.id_lists[n][0]) for n in CAT_COLUMNS],
            non_id_type_features=[NonIDTypeFeature(dense, name="counts")],
            labels=[Label(batch.values["label"].reshape(-1, 1), name="click")],
            requires_grad=requires_grad,
            meta=batch.rows.astype("<i8").tobytes(),
        )


class TsvDataset(IterableDataset):
    """A file's batches made in this process (``DataLoader(TsvDataset(...))``): its
    ``share`` (default: the whole file, outside a data loader)."""

    def __init__(self, path: str, *, batch_size: int, requires_grad: bool,
                 share: ReaderShare | None = None) -> None:
        super().__init__(buffer_size=4)
        self.path, self.batch_size, self.requires_grad = path, batch_size, requires_grad
        self.share = share

    def __iter__(self) -> Iterator[PersiaBatch]:
        return read_batches(self.path, self.batch_size, requires_grad=self.requires_grad,
                            share=self.share)

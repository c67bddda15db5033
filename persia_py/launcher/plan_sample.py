"""Distinct ids per slot, estimated from a sample of the training data (``plan --sample``).

The sample is read with :class:`persia_py.input.readers.CsvReader`, so its ids are the
ones a data loader would send (categorical strings hashed alike). Distinct ids do not grow
in proportion to the data: a sample that is ``1/scale`` of it is extrapolated with Heaps'
law, ``D(n) ~ n**beta``, where beta is read off the sample itself (the distinct ids of its
first half against all of it), between 0 (every id already seen) and 1 (every id new).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from persia_py.input.reader_share import ReaderShare
from persia_py.input.readers import CsvColumn, CsvReader, CsvReaderConfig

CRITEO_INT_COLUMNS = 13
CRITEO_CAT_COLUMNS = 26
_BATCH = 65536


def _columns(path: Path, fmt: str, slots: set[str], delimiter: str
             ) -> tuple[CsvReaderConfig, list[str]]:
    """The reader's layout and the slot columns it reads."""
    if fmt == "criteo":  # label, I1..I13, C1..C26, tab-separated, no header
        names = (["label"] + [f"I{i}" for i in range(1, CRITEO_INT_COLUMNS + 1)]
                 + [f"C{i}" for i in range(1, CRITEO_CAT_COLUMNS + 1)])
        delimiter, header = "\t", False
    elif fmt == "csv":  # a header names the columns; those named like a slot are read
        with open(path) as f:
            names = f.readline().rstrip("\r\n").split(delimiter)
        header = True
    else:
        raise ValueError(f"--sample-format must be 'criteo' or 'csv', got {fmt!r}")
    read = [n for n in names if n in slots]
    if not read:
        raise ValueError(f"--sample {path}: no column is named like a slot of the embedding "
                         f"config (columns: {names[:40]}; slots: {sorted(slots)[:40]})")
    columns = tuple(CsvColumn(name=n, kind="category" if n in slots else "skip")
                    for n in names)
    return CsvReaderConfig(columns=columns, delimiter=delimiter, header=header), read


def estimate_distinct_ids(path: str, slots: set[str], *, fmt: str = "csv",
                          scale: float = 1.0, delimiter: str = ","
                          ) -> tuple[dict[str, int], dict[str, float]]:
    """``(distinct ids per slot, ids per sample per slot)`` for data ``scale`` times the
    sample at ``path``; only the slots the sample has columns for."""
    if not scale >= 1.0:
        raise ValueError(f"--sample-scale must be >= 1 (the data is that many times the "
                         f"sample), got {scale}")
    config, read = _columns(Path(path), fmt, slots, delimiter)
    reader = CsvReader(path, config, share=ReaderShare.whole())
    parts: dict[str, list[np.ndarray]] = {name: [] for name in read}
    records = 0
    for batch in reader.batches(_BATCH):
        records += batch.num_records
        for name in read:
            parts[name].append(batch.id_lists[name][0])
    if records < 2:
        raise ValueError(f"--sample {path}: {records} record(s); a sample needs at least 2")
    distinct, per_sample = {}, {}
    for name in read:
        ids = np.concatenate(parts[name])
        whole = np.unique(ids).shape[0]
        half = np.unique(ids[:ids.shape[0] // 2]).shape[0]
        beta = min(max(math.log2(whole / half), 0.0), 1.0) if half else 1.0
        distinct[name] = math.ceil(whole * scale ** beta)
        per_sample[name] = ids.shape[0] / records
    return distinct, per_sample

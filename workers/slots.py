"""What the embedding worker takes and answers per slot, apart from the worker itself: its
clients (a data loader, an NN worker) use these without importing the worker (or numba,
which its dedup compiles with)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SlotIds", "SlotRows", "pooled_by_kernel"]

FEW_ENTRIES_PER_SAMPLE = 4
"""Up to this many index entries per sample, the NN worker pools a slot with torch's own
``embedding_bag`` and its backward: with few entries its kernels' gain is small, and
their backward runs Python code that must win the GIL from the worker's lookup and
gradient threads, which costs more than it saves (docs/benchmarks.md)."""


def pooled_by_kernel(pooling: str, num_entries: int, batch_size: int) -> bool:
    """Whether the NN worker pools a slot of ``num_entries`` index entries over
    ``batch_size`` samples with its own kernels (:mod:`persia_py.workers.pooling`): sum
    and mean pooling with more than :data:`FEW_ENTRIES_PER_SAMPLE` entries a sample.
    Those take float16 rows as they arrived, so such a slot's rows are not widened
    when they arrive (:mod:`persia_py.workers.half_pooling`)."""
    return pooling != "raw" and num_entries > FEW_ENTRIES_PER_SAMPLE * max(batch_size, 1)


@dataclass(frozen=True)
class SlotIds:
    """One slot of a batch: ids in CSR form (``lengths[i]`` ids for sample i).

    Once validated, a hash-stacked slot holds ``hash_stack_rounds`` ids per raw id
    (consecutive), while ``lengths`` still counts raw ids.
    """

    slot: str
    ids: np.ndarray  # uint64 [num_ids]
    lengths: np.ndarray  # int32 [batch_size]


@dataclass(frozen=True)
class SlotRows:
    """A slot's lookup answer: distinct rows and, per id occurrence, the row it reads."""

    slot: str
    rows: np.ndarray  # float32 or, as the parameter servers sent them, float16 [num_unique, dim]
    index: np.ndarray  # int64 [num_ids * hash_stack_rounds]
    lengths: np.ndarray  # int32 [batch_size], in raw ids
    pooling: str
    sqrt_scaling: bool
    sample_fixed_size: int
    hash_stack_rounds: int = 1
    """Consecutive index entries per raw id; their rows are summed into the id's embedding."""

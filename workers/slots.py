"""What the embedding worker takes and answers per slot, apart from the worker itself: its
clients (a data loader, an NN worker) use these without importing the worker (or numba,
which its dedup compiles with)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SlotIds", "SlotRows"]


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

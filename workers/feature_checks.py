"""What the embedding worker checks of a batch's ID features before it keeps them: each
slot against the embedding config (ids rewritten into the ids its table stores), and the
lookup answer's size against ``common_config.max_message_bytes``.

Validation rewrites a slot's ids: a hash-stacked slot's raw id becomes
``hash_stack_rounds`` bucket ids (summed back into one vector on the NN worker), then the
feature group's prefix replaces the top bits.
"""

from __future__ import annotations

import numpy as np

from persia_py.config import EmbeddingTablesConfig
from persia_py.ids.routing import RESERVED_ID, hash_stack
from persia_py.workers.slots import SlotIds

__all__ = ["check_answer_size", "prefixed", "validate_features"]


def validate_features(config: EmbeddingTablesConfig, features: list[SlotIds],
                      batch_size: int) -> list[SlotIds]:
    """Check a batch's ID features against the config; apply hash stacking and prefix."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    seen = set()
    checked = []
    for f in features:
        slot = config.slot(f.slot)
        if f.slot in seen:
            raise ValueError(f"slot {f.slot!r} appears twice in the batch")
        seen.add(f.slot)
        if f.ids.dtype != np.uint64 or f.ids.ndim != 1:
            raise ValueError(f"slot {f.slot!r}: ids must be 1-D uint64, got {f.ids.dtype}")
        if f.lengths.ndim != 1 or f.lengths.shape[0] != batch_size:
            raise ValueError(
                f"slot {f.slot!r}: lengths has shape {f.lengths.shape}, batch_size is "
                f"{batch_size}"
            )
        if (f.lengths < 0).any() or int(f.lengths.sum()) != f.ids.size:
            raise ValueError(
                f"slot {f.slot!r}: lengths (sum {int(f.lengths.sum())}) do not add up to "
                f"the {f.ids.size} ids"
            )
        if slot.pooling_mode == "raw" and f.lengths.size and f.lengths.max() > slot.sample_fixed_size:
            raise ValueError(
                f"slot {f.slot!r}: a sample has {int(f.lengths.max())} ids, more than "
                f"sample_fixed_size {slot.sample_fixed_size} (ids are never dropped)"
            )
        ids = f.ids
        stack = slot.hash_stack_config
        if stack.hash_stack_rounds:
            ids = hash_stack(ids, stack.hash_stack_rounds, stack.embedding_size)
        ids = prefixed(config, f.slot, ids)
        if (ids == RESERVED_ID).any():
            raise ValueError(f"slot {f.slot!r}: id {int(RESERVED_ID)} is reserved")
        checked.append(SlotIds(f.slot, ids, f.lengths))
    missing = set(config.slots_config) - seen
    if missing:
        raise ValueError(f"batch lacks slots {sorted(missing)} of the embedding config")
    return checked


def prefixed(config: EmbeddingTablesConfig, slot: str, ids: np.ndarray) -> np.ndarray:
    """``ids`` with the top bits replaced by ``slot``'s feature-group prefix."""
    bits = config.feature_index_prefix_bit
    if not bits:
        return ids
    shift = np.uint64(64 - bits)
    mask = np.uint64((1 << (64 - bits)) - 1)
    prefix = np.uint64(config.slot_prefix(slot)) << shift
    return (ids & mask) | prefix


def check_answer_size(config: EmbeddingTablesConfig, slots: list[tuple[str, int, int, int]],
                      *, row_bytes: int, limit: int) -> None:
    """Refuse a batch whose lookup answer could not be sent in one message: per slot
    ``(name, distinct ids, ids, batch size)``, its distinct rows (``row_bytes`` per float,
    as the parameter servers send them), an int64 index per id and an int32 length per
    sample. Counted after dedup: repeated ids cost their index entry only."""
    answer = sum(distinct * config.slots_config[name].dim * row_bytes + 8 * ids + 4 * batch
                 for name, distinct, ids, batch in slots)
    if answer > limit:
        raise ValueError(f"the batch's lookup answer would take {answer} bytes, over "
                         f"max_message_bytes {limit}; send smaller batches")

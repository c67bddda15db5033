"""Criteo-shaped synthetic data whose labels come from a hidden model.

13 dense features and 26 categorical slots, one id per slot per sample, ids drawn from a
Zipf distribution. Each (slot, id) has a hidden effect that is a pure function of the id,
so train and test share it; the label is Bernoulli(sigmoid(hidden logit)). A model that
learns the embeddings of frequent ids beats chance clearly; one that learns nothing
scores an AUC of 0.5.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

NUM_DENSE = 13
NUM_SLOTS = 26
SLOT_NAMES = [f"C{i + 1}" for i in range(NUM_SLOTS)]
SPLIT_SEEDS = {"train": 1, "test": 2}


def _hidden_effect(slot: int, ids: np.ndarray) -> np.ndarray:
    """The hidden per-id effect, uniform in [-1, 1), a pure function of (slot, id)."""
    with np.errstate(over="ignore"):
        z = ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(slot * 7919 + 1)
        z = (z ^ (z >> np.uint64(31))) * np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(29)
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53) * 2.0 - 1.0


def make_batches(
    split: str,
    num_samples: int,
    batch_size: int,
    *,
    vocab_size: int = 20_000,
    zipf_a: float = 1.2,
    part: int = 0,
    num_parts: int = 1,
) -> Iterator[tuple[np.ndarray, list[np.ndarray], np.ndarray]]:
    """Yield ``(dense [B, 13] float32, ids: 26 x uint64 [B], labels [B, 1] float32)``.

    ``part`` of ``num_parts`` gives a disjoint share of the split (one per data loader).
    """
    if split not in SPLIT_SEEDS:
        raise ValueError(f"split must be one of {sorted(SPLIT_SEEDS)}, got {split!r}")
    dense_weights = np.random.default_rng(0).normal(0.0, 0.4, NUM_DENSE)
    num_batches = -(-num_samples // batch_size)
    for b in range(part, num_batches, num_parts):
        rng = np.random.default_rng([SPLIT_SEEDS[split], b])
        size = min(batch_size, num_samples - b * batch_size)
        dense = rng.normal(0.0, 1.0, (size, NUM_DENSE))
        logit = dense @ dense_weights - 0.5
        ids = []
        for slot in range(NUM_SLOTS):
            slot_ids = (rng.zipf(zipf_a, size) - 1) % vocab_size
            slot_ids = slot_ids.astype(np.uint64)
            logit = logit + 0.6 * _hidden_effect(slot, slot_ids)
            ids.append(slot_ids)
        labels = rng.random(size) < 1.0 / (1.0 + np.exp(-logit))
        yield dense.astype(np.float32), ids, labels.astype(np.float32).reshape(-1, 1)

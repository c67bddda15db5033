"""The two training workloads of the throughput benchmark, shared by both sides.

* dense-heavy (DLRM-like): 13 dense features, 26 slots x 1 id (Zipf over 1M ids per
  slot), dim 16, bottom MLP 512-256-16, pairwise dot interactions, top MLP 512-256-1,
  batch 2048.
* embedding-heavy: 26 slots x 20 ids (Zipf over 200k ids per slot), dim 32, one hidden
  layer of 256, batch 1024.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

WARMUP_STEPS = 20
"""Steps before either side starts its clock: process start-up, first page faults, and
for persia_py the filling of the pipeline."""
SMOKE_WARMUP_STEPS = 1
"""The warm-up of a smoke run (``--smoke``: tiny tables and batches, figures meaningless)."""

NUM_DENSE = 13
NUM_SLOTS = 26
SLOT_NAMES = [f"s{i}" for i in range(NUM_SLOTS)]


@dataclass(frozen=True)
class Workload:
    name: str
    ids_per_slot: int
    vocab: int
    dim: int
    batch_size: int
    zipf_a: float = 1.1

    def batch(self, index: int) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        """Batch ``index``: dense [B, 13], per slot uint64 ids [B * ids_per_slot], labels [B, 1]."""
        rng = np.random.default_rng([7, index])
        b = self.batch_size
        dense = rng.normal(size=(b, NUM_DENSE)).astype(np.float32)
        ids = [((rng.zipf(self.zipf_a, b * self.ids_per_slot) - 1) % self.vocab).astype(np.uint64)
               for _ in range(NUM_SLOTS)]
        labels = (rng.random((b, 1)) < 0.3).astype(np.float32)
        return dense, ids, labels

    def smoke(self) -> Workload:
        """The same workload, tiny: for a check that the benchmark runs (``--smoke``)."""
        return replace(self, vocab=1000, batch_size=32)

    def model(self) -> nn.Module:
        if self.name == "dense_heavy":
            return DLRM(self.dim)
        return OneHidden(self.dim)


WORKLOADS = {
    "dense_heavy": Workload("dense_heavy", ids_per_slot=1, vocab=1_000_000, dim=16,
                            batch_size=2048),
    "embedding_heavy": Workload("embedding_heavy", ids_per_slot=20, vocab=200_000, dim=32,
                                batch_size=1024),
}


def workload(name: str, smoke: bool = False, *, batch_size: int | None = None,
             ids_per_slot: int | None = None, vocab: int | None = None) -> Workload:
    """The workload ``name`` of :data:`WORKLOADS`, tiny when ``smoke``; sizes given
    (``benchmarks.scaling``'s) win over both."""
    w = WORKLOADS[name].smoke() if smoke else WORKLOADS[name]
    sizes = {"batch_size": batch_size, "ids_per_slot": ids_per_slot, "vocab": vocab}
    for option, value in sizes.items():
        if value is not None and value < 1:
            raise ValueError(f"workload {name}: {option} must be at least 1, got {value}")
    return replace(w, **{k: v for k, v in sizes.items() if v is not None})


def add_size_options(parser: argparse.ArgumentParser) -> None:
    """The options of :func:`workload`'s sizes, for the job's scripts."""
    parser.add_argument("--batch-size", type=int, default=None, help="samples per batch")
    parser.add_argument("--ids-per-slot", type=int, default=None, help="ids per sample per slot")
    parser.add_argument("--vocab", type=int, default=None, help="id range of each slot")


def sized(args: argparse.Namespace) -> Workload:
    """The workload the script's ``--workload``, ``--smoke`` and size options name."""
    return workload(args.workload, args.smoke, batch_size=args.batch_size,
                    ids_per_slot=args.ids_per_slot, vocab=args.vocab)


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.bottom = mlp([NUM_DENSE, 512, 256, dim])
        num_vectors = NUM_SLOTS + 1
        self.top = mlp([dim + num_vectors * (num_vectors - 1) // 2, 512, 256, 1])
        rows, cols = torch.triu_indices(num_vectors, num_vectors, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def forward(self, dense: list[torch.Tensor], embeddings: list[torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense[0])
        vectors = torch.stack([x, *embeddings], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.rows, self.cols]
        return torch.sigmoid(self.top(torch.cat([x, dots], dim=1)))


class OneHidden(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = mlp([NUM_DENSE + NUM_SLOTS * dim, 256, 1])

    def forward(self, dense: list[torch.Tensor], embeddings: list[torch.Tensor]) -> torch.Tensor:
        return torch.sigmoid(self.net(torch.cat([dense[0], *embeddings], dim=1)))

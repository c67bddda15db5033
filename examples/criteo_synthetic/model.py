"""A DLRM-style model: bottom MLP on dense features, pairwise dot-product interactions of
the dense vector and every slot's embedding, top MLP to a click probability."""

from __future__ import annotations

import torch
from torch import nn


def mlp(sizes: list[int], last_activation: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, num_dense: int = 13, num_slots: int = 26, dim: int = 16,
                 bottom: tuple[int, ...] = (64,), top: tuple[int, ...] = (128, 64)) -> None:
        super().__init__()
        self.bottom = mlp([num_dense, *bottom, dim])
        num_vectors = num_slots + 1
        num_pairs = num_vectors * (num_vectors - 1) // 2
        self.top = mlp([dim + num_pairs, *top, 1], last_activation=False)
        rows, cols = torch.triu_indices(num_vectors, num_vectors, offset=1)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)

    def forward(self, non_id_tensors: list[torch.Tensor],
                embedding_tensors: list[torch.Tensor]) -> torch.Tensor:
        dense = self.bottom(non_id_tensors[0])
        vectors = torch.stack([dense, *embedding_tensors], dim=1)  # [B, 27, dim]
        dots = torch.bmm(vectors, vectors.transpose(1, 2))
        pairs = dots[:, self.pair_rows, self.pair_cols]
        return torch.sigmoid(self.top(torch.cat([dense, pairs], dim=1)))

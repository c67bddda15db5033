"""Embeddings concatenated with the transformed counts, then an MLP to a click logit."""

from __future__ import annotations

import torch
from torch import nn


class ConcatMLP(nn.Module):
    def __init__(self, num_dense: int = 13, num_slots: int = 26, dim: int = 8,
                 hidden: tuple[int, ...] = (64, 32)) -> None:
        super().__init__()
        sizes = [num_dense + num_slots * dim, *hidden]
        layers: list[nn.Module] = []
        for a, b in zip(sizes, sizes[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(sizes[-1], 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, non_id_tensors: list[torch.Tensor],
                embedding_tensors: list[torch.Tensor]) -> torch.Tensor:
        """Logits ``[B, 1]`` (train with ``BCEWithLogitsLoss``)."""
        return self.mlp(torch.cat([non_id_tensors[0], *embedding_tensors], dim=1))

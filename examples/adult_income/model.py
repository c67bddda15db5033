"""PERSIA's adult-income model shape: a dense MLP with batch norm over 5 numeric features,
a sparse MLP over the 8 concatenated slot embeddings, and a small tower."""

from __future__ import annotations

import torch
from torch import nn


class DNN(nn.Module):
    def __init__(self, num_dense: int = 5, num_slots: int = 8, dim: int = 8,
                 dense_out: int = 16, sparse_out: int = 128) -> None:
        super().__init__()
        self.dense_mlp = nn.Linear(num_dense, dense_out)
        self.dense_bn = nn.BatchNorm1d(dense_out)
        self.sparse_mlp = nn.Linear(num_slots * dim, sparse_out)
        self.sparse_bn = nn.BatchNorm1d(sparse_out)
        self.ln1 = nn.Linear(dense_out + sparse_out, 256)
        self.ln2 = nn.Linear(256, 128)
        self.ln3 = nn.Linear(128, 1)

    def forward(self, non_id_tensors: list[torch.Tensor],
                embedding_tensors: list[torch.Tensor]) -> torch.Tensor:
        sparse = self.sparse_bn(self.sparse_mlp(torch.cat(embedding_tensors, dim=1)))
        dense = self.dense_bn(self.dense_mlp(non_id_tensors[0]))
        x = torch.cat([sparse, dense], dim=1)
        return torch.sigmoid(self.ln3(self.ln2(self.ln1(x))))

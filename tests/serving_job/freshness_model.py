"""The dense tower of tests/test_serving_freshness.py: small, deterministic, and one
whose output moves visibly with every optimizer step."""

import torch


class Tower(torch.nn.Module):
    """``sigmoid(w . [dense, user, item] + b)`` through one hidden layer."""

    def __init__(self, dense_dim: int = 2, emb_dim: int = 4) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(dense_dim + 2 * emb_dim, 8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, dense: list[torch.Tensor], embeddings: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat([dense[0], *embeddings], dim=1)
        return torch.sigmoid(self.out(torch.relu(self.hidden(x))))

"""Small helpers of PERSIA's ``persia.utils`` that training scripts call."""

from __future__ import annotations

import random

import numpy as np
import torch

from persia_py.config.checks import check_number

__all__ = ["setup_seed"]


def setup_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch (CPU and every CUDA
    device), and, where CUDA is available, make cuDNN pick deterministic kernels (as
    PERSIA's ``setup_seed``). The embedding rows are seeded apart, by
    :class:`persia_py.embedding.EmbeddingConfig`'s ``seed``.

    ``seed`` must be an int in [0, 2**32 - 1] (NumPy's range)."""
    seed = int(check_number("seed", seed, low=0, high=2**32 - 1, integer=True))
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too
    if torch.cuda.is_available():
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False

"""Small collectives of the NN ranks, and what joins them (``torch.distributed`` ``Join``).

A rank that ran out of batches while the others train on must take part in every
collective they make, through the :class:`~torch.distributed.algorithms.join.JoinHook`
of each piece that makes one (the dense tower, periodic checkpoints, the agreement to
stop, progressive validation). Those pieces share the group and device rules here.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable


def collective_device(device: torch.device) -> torch.device:
    """Where a small collective's tensor lives: ``device`` under NCCL, else the CPU."""
    nccl = dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
    return device if nccl else torch.device("cpu")


class WorldJoinable(Joinable):
    """A :class:`Joinable` over the default process group; ``_device`` is the rank's
    device (set by the subclass)."""

    _device: torch.device = torch.device("cpu")

    @property
    def join_device(self) -> torch.device:
        return collective_device(self._device)

    @property
    def join_process_group(self):
        return dist.group.WORLD


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_gather_arrays(array: np.ndarray, device: torch.device | None = None) -> np.ndarray:
    """Every rank's 1-D ``array`` (lengths may differ) concatenated in rank order.
    ``array`` must have the same dtype on every rank (a torch-supported one)."""
    array = np.ascontiguousarray(array).reshape(-1)
    if _world_size() == 1:
        return array
    device = device or torch.device("cpu")
    mine = torch.from_numpy(array).to(device)
    size = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(_world_size())]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=mine.dtype, device=device)
    padded[:mine.numel()] = mine
    every = [torch.zeros_like(padded) for _ in range(_world_size())]
    dist.all_gather(every, padded)
    return np.concatenate([t[:int(n.item())].cpu().numpy() for t, n in zip(every, sizes)])

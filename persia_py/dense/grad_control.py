"""Dense step control: gradient clipping and accumulation over several batches.

``TrainCtx(grad_clip_norm=..., grad_accumulation_steps=k)`` keeps ``ctx.backward(loss)``
as PERSIA's one call per batch, and changes what happens to the dense tower:

* **Accumulation**: the dense optimizer steps once every ``k`` batches, on the mean of
  their dense gradients, so ``k`` batches of ``B`` samples step as one batch of ``k * B``
  (for a loss that averages over the batch). Under DDP the first ``k - 1`` backwards of a
  window skip the allreduce (DDP's ``no_sync``): one allreduce per step, not per batch.
  Windows are counted in trained batches since the start of the job (resumes included),
  so they line up with periodic checkpoints, whose period must be a multiple of ``k``.
  When the stream ends inside a window, its gradients are summed over the ranks and
  applied in one last step: nothing trained is dropped.
* **Clipping**: before every dense step, the dense gradients are scaled so that their
  total L2 norm (over every dense parameter, every rank's shard under FSDP) is at most
  ``grad_clip_norm`` (``torch.nn.utils.clip_grad_norm_``), after AMP's unscaling.

Embedding gradients are not touched by either: each batch's go to the parameter servers
with that batch, as without them (the servers' optimizer and ``weight_bound`` apply).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from persia_py.config.checks import check_type


@dataclass(frozen=True, kw_only=True)
class GradControl:
    """What ``TrainCtx`` does with the dense gradients before stepping."""

    grad_clip_norm: float | None = None
    """Most total L2 norm of the dense gradients at a step; None: no clipping."""
    grad_accumulation_steps: int = 1
    """Batches per dense optimizer step (1: a step after every batch, as PERSIA)."""

    def __post_init__(self) -> None:
        # A value of the wrong kind ("1", 2.5 steps) is a TypeError; a number out of
        # range (0, -1, inf) a ValueError, as for every other argument of TrainCtx.
        clip = self.grad_clip_norm
        check_type("TrainCtx(grad_clip_norm=...)", clip, (int, float),
                   "a finite number > 0 or None", optional=True)
        if clip is not None and (not math.isfinite(clip) or clip <= 0):
            raise ValueError(f"TrainCtx(grad_clip_norm=...): expected a finite number > 0 or "
                             f"None, got {clip!r}")
        k = self.grad_accumulation_steps
        check_type("TrainCtx(grad_accumulation_steps=...)", k, int, "an int >= 1")
        if k < 1:
            raise ValueError(f"TrainCtx(grad_accumulation_steps=...): expected an int >= 1, "
                             f"got {k!r}")

    def steps_at(self, trained: int) -> bool:
        """Whether the dense optimizer steps after batch number ``trained`` (1-based)."""
        return trained % self.grad_accumulation_steps == 0

    def check_checkpoint_period(self, every_steps: int) -> None:
        """ValueError unless periodic checkpoints fall between windows."""
        if every_steps and every_steps % self.grad_accumulation_steps:
            raise ValueError(
                f"checkpoint_config.every_steps={every_steps} is not a multiple of "
                f"TrainCtx(grad_accumulation_steps={self.grad_accumulation_steps}): a "
                f"checkpoint inside an accumulation window would lose its gradients; make "
                f"it a multiple")


def dense_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def scale_grads_(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Multiply every dense gradient by ``factor`` in place."""
    grads = [p.grad for p in dense_params(optimizer) if p.grad is not None]
    if grads and factor != 1.0:
        torch._foreach_mul_(grads, factor)


def clip_grads_(optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """Clip the dense gradients to total L2 norm ``max_norm``; returns the norm before.
    DTensor shards (FSDP) are reduced over the ranks by torch itself: every rank calls it."""
    return torch.nn.utils.clip_grad_norm_(
        [p for p in dense_params(optimizer) if p.grad is not None], max_norm)


def sum_over_ranks_(optimizer: torch.optim.Optimizer, count: int,
                    device: torch.device) -> int:
    """Sum every rank's local dense gradients (and batch counts) in place; returns the
    total count. For the end of a stream inside an accumulation window, when the last
    backwards skipped DDP's allreduce: every rank of the group calls it (a rank with
    nothing left contributes zeros)."""
    grads: list[torch.Tensor] = []
    for p in dense_params(optimizer):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    flat = torch.cat([g.reshape(-1).float() for g in grads]
                     + [torch.tensor([float(count)], device=grads[0].device)])
    if dist.get_backend() == "gloo":
        flat = flat.cpu()
    elif flat.device != device:
        flat = flat.to(device)
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n
    return int(round(float(flat[-1])))

"""The dense optimizer step of one NN-worker rank, apart from the context that calls it.

:class:`DenseStep` runs backward (scaled under CUDA AMP), the optimizer step when a batch
ends an accumulation window (on the mean gradient, clipped first), skips a step whose
gradients are not all finite on every rank, and, at the end of a stream, takes the last
window's step so that no trained batch's dense gradient is dropped. ``TrainCtx`` owns one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from persia_py.dense.grad_control import GradControl, clip_grads_, scale_grads_, sum_over_ranks_
from persia_py.dense.parallel import DenseParallel

__all__ = ["DenseStep"]

logger = logging.getLogger(__name__)


class DenseStep:
    """Backward and the dense optimizer step of one rank (see the module docstring).

    Args:
        optimizer: the dense optimizer.
        grad_control: clipping and accumulation settings.
        dense: the dense tower as the ranks share it.
        scaler: CUDA AMP's gradient scaler (None: no scaling).
        rank: this rank, for messages.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, grad_control: GradControl,
                 dense: DenseParallel, *, scaler: torch.amp.GradScaler | None,
                 rank: int) -> None:
        self.optimizer = optimizer
        self.grad_control = grad_control
        self.scaler = scaler
        self.rank = rank
        self.dense = dense
        """The dense tower as the ranks share it (set again by the context when it wraps it)."""
        self.num_skipped = 0
        """Steps skipped for non-finite gradients (without a gradient scaler; with one,
        the scaler skips and lowers its scale)."""

    def backward(self, loss: torch.Tensor, steps_done: int) -> float | None:
        """Backward of ``loss``, and the dense optimizer step when the ``steps_done``-th
        batch ends an accumulation window; returns the factor that unscales the embedding
        rows' gradients under AMP (None without a gradient scaler)."""
        if self.scaler is None:
            loss.backward()
            unscale = None
        else:
            self.scaler.scale(loss).backward()
            unscale = 1.0 / self.scaler.get_scale()
        if self.grad_control.steps_at(steps_done):
            self.step(self.grad_control.grad_accumulation_steps)
        return unscale

    def step(self, num_batches: int) -> None:
        """The dense optimizer step on the mean gradient of the last ``num_batches``
        batches, clipped to ``grad_clip_norm``."""
        optimizer, clip = self.optimizer, self.grad_control.grad_clip_norm
        if self.scaler is None:
            scale_grads_(optimizer, 1.0 / num_batches)
            # A step whose dense gradients are not all finite is skipped on every rank
            # (the scaler's own check does that under CUDA AMP); the embedding worker
            # skips a slot's non-finite embedding gradients.
            if self.dense.grads_finite(optimizer):
                if clip is not None:
                    clip_grads_(optimizer, clip)
                optimizer.step()
            else:
                self.num_skipped += 1
                logger.warning("rank %d: non-finite dense gradients, optimizer step skipped "
                               "(%d so far)", self.rank, self.num_skipped)
        else:
            if clip is not None or num_batches > 1:
                self.scaler.unscale_(optimizer)  # clip the true gradients, not scaled ones
                scale_grads_(optimizer, 1.0 / num_batches)
                if clip is not None:
                    clip_grads_(optimizer, clip)
            self.scaler.step(optimizer)
            self.scaler.update()
        optimizer.zero_grad(set_to_none=True)
        self.dense.after_step()

    def finish(self, steps_done: int, device: torch.device,
               naming_peers: Callable[[str], AbstractContextManager]) -> None:
        """At the end of a stream inside an accumulation window: sum the window's dense
        gradients over the ranks (their last backwards skipped the allreduce) and take
        the step, so that no trained batch's dense gradient is dropped. Every rank calls
        it, after the stream's Join."""
        k = self.grad_control.grad_accumulation_steps
        if k == 1:
            return
        left = steps_done % k
        if self.dense.joinable is not None:
            with naming_peers("the last accumulation window's allreduce"):
                left = sum_over_ranks_(self.optimizer, left, device)
        if left:
            self.step(left)

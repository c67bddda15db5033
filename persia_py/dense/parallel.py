"""The dense tower as the NN-worker ranks share it, step by step (what
:mod:`persia_py.distributed`'s options build): a replica (DDP, or whole with one rank) or
FSDP shards, with what each needs around a training step:

* **Uneven inputs** (``torch.distributed.algorithms.Join``): DDP has its own join hook; FSDP
  has none, so :class:`FSDPParallel` is a Joinable whose hook replays a step with a zero
  loss for every step the others still train. A rank with no batch at all has nothing to
  replay: at the first step of every Join, the ranks tell each other who trains, and a
  rank that does not gets the inputs of the lowest rank that does.
* **Non-finite gradients**: :meth:`DenseParallel.grads_finite` says whether the dense
  gradients of a step are all finite, with the same answer on every rank (FSDP ranks
  hold different gradient shards, so they agree through one allreduce), so that a step
  is skipped everywhere or nowhere.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms import Join, Joinable, JoinHook

from persia_py.dense.collectives import broadcast_tensors
from persia_py.dense.fsdp_limiter import UnshardedBytesMeter

Inputs = tuple[list[torch.Tensor], list[torch.Tensor]]
"""A training forward's inputs: the non-ID tensors and the pooled embeddings."""
MAX_JOIN_INPUT_BYTES = 1 << 34
"""Bound of one batch's inputs a rank without a batch of its own receives to shadow a
step (they came over gRPC, each message within ``common_config.max_message_bytes``)."""


def _local_grads_finite(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this rank's gradients (its shards under FSDP) of ``optimizer``'s
    parameters are all finite; one reduction per parameter, not per element.

    First by their sums (one pass, nothing allocated: a NaN or an infinity makes a sum
    non-finite); only where a sum is not finite, which finite values can also give by
    overflowing, element by element."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    local = [g for g in local if g.numel()]
    if not local:
        return True
    if bool(torch.isfinite(torch.stack([g.sum() for g in local])).all()):
        return True
    return bool(torch.stack([torch.isfinite(g).all() for g in local]).all())


class DenseParallel:
    """The dense tower as the ranks share it: ``module`` is what forward calls;
    ``joinable`` (None with one rank) lets ranks with fewer batches shadow the others'
    collectives inside ``torch.distributed.algorithms.Join``."""

    sharded = False

    def __init__(self, model: nn.Module, module: nn.Module,
                 joinable: Joinable | None = None) -> None:
        self.model = model
        self.module = module
        self.joinable = joinable

    def before_forward(self, dense: list[torch.Tensor],
                       embeddings: list[torch.Tensor]) -> None:
        """Called before each training forward, with its inputs."""

    def set_gradient_sync(self, enabled: bool) -> None:
        """Whether the next backward reduces the gradients over the ranks (False inside
        a gradient accumulation window): DDP's ``no_sync`` flag, read by its forward."""
        if isinstance(self.module, nn.parallel.DistributedDataParallel):
            self.module.require_backward_grad_sync = enabled

    def grads_finite(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the dense gradients of this step are all finite. DDP's gradients are
        allreduced (one non-finite value on a rank makes the sum non-finite on all), so
        every rank gives the same answer without talking."""
        return _local_grads_finite(optimizer)

    def after_step(self) -> None:
        """Called after each optimizer step."""

    def summary(self) -> str | None:
        """A line for the end-of-run log, or None."""
        return None


class FSDPParallel(DenseParallel, Joinable):
    """FSDP2-sharded tower with its unsharded-bytes meter.

    FSDP has no Join support of its own: as a Joinable, a rank that is out of batches
    runs ``shadow_step(dense, embeddings)`` (a step with a zero loss, contributing zero
    gradients, while its shard of the optimizer step still runs) for every step the
    others still train, as DDP's Join shadows the allreduce with zeros. It replays its
    last inputs; a rank that had none in this Join gets another rank's (see the module
    doc)."""

    sharded = True

    def __init__(self, model: nn.Module, meter: UnshardedBytesMeter,
                 shadow_step: Callable[[list[torch.Tensor], list[torch.Tensor]], None]
                 ) -> None:
        DenseParallel.__init__(self, model, model, joinable=self)
        Joinable.__init__(self)
        self.meter = meter
        self._shadow_step = shadow_step
        self._last_inputs: Inputs | None = None
        self._join_steps = 0  # steps of the current Join, trained or shadowed

    def before_forward(self, dense: list[torch.Tensor],
                       embeddings: list[torch.Tensor]) -> None:
        Join.notify_join_context(self)  # the per-step "who is still training" allreduce
        self._last_inputs = (dense, [e.detach() for e in embeddings])
        self._start_of_join(training=True)

    def _shadow(self) -> None:
        self._start_of_join(training=False)
        if self._last_inputs is None:  # no rank trains in this step: Join would not call
            raise AssertionError("FSDP join: a step to shadow but no inputs to replay")
        self._shadow_step(*self._last_inputs)

    def _start_of_join(self, *, training: bool) -> None:
        """At the first step of a Join, every rank (training or shadowing) takes part in
        one allreduce of who trains; if some rank does not, the lowest rank that does
        broadcasts its inputs and those without inputs of their own keep them. The rank
        that joined before the first step is the one with no batch in this Join."""
        self._join_steps += 1
        if self._join_steps != 1:
            return
        world, rank = dist.get_world_size(), dist.get_rank()
        training_ranks = torch.zeros(world, device=self.join_device)
        training_ranks[rank] = float(training)
        dist.all_reduce(training_ranks)
        if bool(training_ranks.all()):
            return
        src = int(torch.nonzero(training_ranks)[0])
        # Once per Join at most: dtypes and shapes as JSON, then the tensors (nothing pickled).
        dense, embeddings = broadcast_tensors(self._last_inputs, src,
                                              max_bytes=MAX_JOIN_INPUT_BYTES,
                                              device=self.join_device, what="a batch to shadow")
        if self._last_inputs is None:
            self._last_inputs = (dense, embeddings)

    def grads_finite(self, optimizer: torch.optim.Optimizer) -> bool:
        """Every rank's gradient shards finite (one allreduce: the ranks hold different
        shards, and a value that is not finite may sit in one rank's only)."""
        finite = torch.tensor([float(_local_grads_finite(optimizer))],
                              device=self.join_device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite.item())

    def after_step(self) -> None:
        self.meter.after_step()

    def summary(self) -> str:
        bound = self.meter.bound
        return (f"FSDP peak unsharded bytes {self.meter.peak}"
                + (f" of max_unsharded_bytes {bound}" if bound is not None else " (no bound)"))

    def join_hook(self, **kwargs) -> JoinHook:
        self._join_steps = 0  # Join makes its hooks once, on construction: a new Join
        return _ShadowStep(self._shadow)

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu") if dist.get_backend() == "gloo" else torch.device(
            "cuda", torch.cuda.current_device())

    @property
    def join_process_group(self):
        return dist.group.WORLD


class _ShadowStep(JoinHook):
    def __init__(self, step: Callable[[], None]) -> None:
        self._step = step

    def main_hook(self) -> None:
        self._step()

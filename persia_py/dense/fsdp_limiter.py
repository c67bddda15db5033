"""The rate limiter of FSDP: a bound on unsharded parameter bytes alive at once.

An FSDP *unit* (a module given to ``fully_shard``) holds only its shard between uses;
before its forward and its backward its parameters are all-gathered. What is alive at a
moment is every unit whose all-gather has been issued and whose gathered bytes are not
yet freed. In PyTorch's FSDP2 that is two buffers per unit, both counted here:

* the all-gather's flat output buffer (allocated when the all-gather is issued; in
  forward it is kept until the next unit's copy-out, for overlap);
* the unsharded parameters, copied out of that buffer (freed when the unit reshards).

So a unit costs up to twice its unsharded size for a moment (buffer and parameters),
and the least any bound can be is that, plus the root's parameters (:func:`floor_bytes`).
Above that floor the limiter spends the rest on **prefetching**: issuing the next units'
all-gathers early (FSDP's ``set_modules_to_forward_prefetch`` /
``set_modules_to_backward_prefetch``), as far ahead as the bound allows
(:func:`plan_prefetch`), which on a GPU overlaps communication with compute. The plan
follows the order the units ran in during the first step, which runs at the floor.

:class:`UnshardedBytesMeter` measures the bytes for real: it reads the storage of the
gathered tensors at every moment bytes can grow (right after an all-gather is issued and
right after its copy-out), keeps the peak, and raises if the bound is ever exceeded.
Gradients are not counted (FSDP reduce-scatters and frees them per unit).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

logger = logging.getLogger(__name__)


def unit_bytes(params: Sequence[torch.nn.Parameter], world_size: int,
               param_dtype: torch.dtype | None = None) -> int:
    """Unsharded bytes of a unit's parameters as FSDP2 gathers them: dim 0 padded to a
    multiple of ``world_size`` (FSDP's even shards), in ``param_dtype`` when given."""
    total = 0
    for p in params:
        dtype = param_dtype if (param_dtype is not None and p.is_floating_point()) else p.dtype
        elem = torch.empty((), dtype=dtype).element_size()
        if p.dim() == 0:
            total += world_size * elem  # a scalar becomes one row per rank
            continue
        rows = -(-p.shape[0] // world_size) * world_size
        total += rows * (p.numel() // max(p.shape[0], 1)) * elem
    return total


def floor_bytes(units: Sequence[int], root: int, *, reshard_after_forward: bool) -> int:
    """The least bound that training fits in, with no prefetching: the root's parameters
    (buffer and copy) plus the largest unit's (buffer and copy); without
    ``reshard_after_forward`` every unit stays gathered until its backward, so all of them."""
    largest = max(units, default=0)
    if not reshard_after_forward:
        return 2 * root + sum(units) + largest
    return 2 * root + 2 * largest


def plan_prefetch(units: Sequence[int], root: int, bound: int) -> list[list[int]]:
    """Which later units each unit prefetches, for one pass whose units run in the order
    of ``units`` (their unsharded bytes): as many as fit.

    At unit ``m``, with the units up to ``last`` already issued, the bytes alive are at
    most ``2 * root + 2 * units[m] + sum(units[m + 1 : last + 1])`` (its buffer and copy,
    the prefetched buffers); a prefetch is issued only if that stays within ``bound`` at
    every unit until the prefetched one runs."""
    n, fixed = len(units), 2 * root
    plan: list[list[int]] = [[] for _ in range(n)]
    last = -1

    def fits(upto: int, start: int) -> bool:
        return all(fixed + 2 * units[m] + sum(units[m + 1:upto + 1]) <= bound
                   for m in range(start, upto))

    for i in range(n):
        last = max(last, i)
        while last + 1 < n and fits(last + 1, i):
            last += 1
            plan[i].append(last)
    return plan


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.untyped_storage().nbytes()


@dataclass
class _Unit:
    module: FSDPModule
    group: FSDPParamGroup  # FSDP2's internals, of the pinned torch


class UnshardedBytesMeter:
    """Measures the unsharded parameter bytes alive across ``units`` (FSDP2 modules, root
    last) and enforces ``bound``; plans the prefetches after the first step.

    It wraps, on each unit's parameter group *instance*, the two methods after which
    bytes can have grown (``unshard``: an all-gather issued; ``wait_for_unshard``: its
    copy-out), and reads the gathered tensors' storage there. This reads FSDP2's
    internals of the pinned torch; a torch that renames them fails here, loudly.
    """

    def __init__(self, units: Sequence[torch.nn.Module], sizes: Sequence[int], *,
                 bound: int | None, root_bytes: int) -> None:
        self.bound = bound
        self.peak = 0
        """Most unsharded bytes alive at once, measured, since the start."""
        self.current = 0
        self._root_bytes = root_bytes
        self._root = units[-1] if units else None
        self._units: list[_Unit] = []
        self._order: list[int] = []  # units in the order of the first forward
        self._planned = False
        self.plan_forward: list[list[int]] = []
        self.plan_backward: list[list[int]] = []
        self._sizes: list[int] = []
        from torch.distributed.fsdp import FSDPModule

        for module, size in zip(units, sizes):
            assert isinstance(module, FSDPModule), "a unit not given to fully_shard"
            group = module._get_fsdp_state()._fsdp_param_group
            if group is None:  # a unit with no parameters of its own
                continue
            index = len(self._units)
            self._units.append(_Unit(module, group))
            self._sizes.append(size)
            # The root stays gathered from its forward to its backward (FSDP does not
            # reshard it after forward): it is in ``root_bytes``, not in the plan.
            self._wrap(index, group, ordered=module is not units[-1])
        if bound is not None:
            # Until the plan is made (after the first step), no prefetch at all: an
            # explicit backward prefetch of the unit itself, already gathered, is a no-op
            # that turns FSDP's default one-ahead prefetch off.
            for u in self._units:
                u.module.set_modules_to_forward_prefetch([])
                u.module.set_modules_to_backward_prefetch([u.module])

    # -- measuring -----------------------------------------------------------------------

    def _alive(self) -> int:
        total = 0
        for u in self._units:
            g = u.group
            for p in g.fsdp_params:
                for t in getattr(p, "all_gather_outputs", ()):
                    total += _nbytes(t)
            if g._all_gather_result is not None:
                total += _nbytes(g._all_gather_result.all_gather_output)
        kept = self._units[0].group.comm_ctx.all_gather_state if self._units else None
        if kept is not None:
            total += _nbytes(kept.all_gather_result.all_gather_output)
        return total

    def _record(self, alive: int) -> None:
        self.current = alive
        if alive > self.peak:
            self.peak = alive
        if self.bound is not None and alive > self.bound:
            raise RuntimeError(
                f"FSDP: {alive} unsharded bytes alive, over max_unsharded_bytes="
                f"{self.bound}; the prefetch plan {self.plan_forward} / "
                f"{self.plan_backward} does not fit this model's order of units")

    def _wrap(self, index: int, group, ordered: bool) -> None:
        unshard, wait, pre_forward = group.unshard, group.wait_for_unshard, group.pre_forward

        def metered_unshard(*args, **kwargs):
            unshard(*args, **kwargs)
            self._record(self._alive())

        def metered_wait(*args, **kwargs):
            result = group._all_gather_result
            staging = None if result is None else result.all_gather_output
            wait(*args, **kwargs)
            kept = group.comm_ctx.all_gather_state
            still_held = kept is not None and kept.all_gather_result.all_gather_output is staging
            # The copy-out ran while its buffer was alive; in backward FSDP frees the
            # buffer before returning, so add it back for the moment in between.
            self._record(self._alive() + (0 if still_held else _nbytes(staging)))

        def ordered_pre_forward(*args, **kwargs):
            if ordered and not self._planned and index not in self._order:
                self._order.append(index)
            return pre_forward(*args, **kwargs)

        group.unshard = metered_unshard
        group.wait_for_unshard = metered_wait
        group.pre_forward = ordered_pre_forward

    # -- planning ------------------------------------------------------------------------

    def after_step(self) -> None:
        """After the first step: plan the prefetches within the bound, in the order
        the units ran."""
        if self._planned:
            return
        self._planned = True
        planned_units = len(self._units) - (self._units[-1].module is self._root)
        if self.bound is None or len(self._order) != planned_units:
            return  # no bound: FSDP's defaults; units skipped in step 1: stay at the floor
        sizes = [self._sizes[i] for i in self._order]
        forward = plan_prefetch(sizes, self._root_bytes, self.bound)
        backward = plan_prefetch(sizes[::-1], self._root_bytes, self.bound)
        order = [self._units[i].module for i in self._order]
        for pos, targets in enumerate(forward):
            order[pos].set_modules_to_forward_prefetch([order[t] for t in targets])
        rev = order[::-1]
        for pos, targets in enumerate(backward):
            rev[pos].set_modules_to_backward_prefetch([rev[t] for t in targets] or [rev[pos]])
        self.plan_forward = [[self._order[t] for t in ts] for ts in forward]
        self.plan_backward = [[self._order[::-1][t] for t in ts] for ts in backward]
        logger.info("FSDP prefetch within %d bytes: forward %s, backward %s", self.bound,
                    forward, backward)

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Expose the peak and the bound as gauges, read when scraped."""
        registry.register(_MeterCollector(self))


class _MeterCollector(Collector):
    def __init__(self, meter: UnshardedBytesMeter) -> None:
        self._meter = meter

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("persia_nn_worker_fsdp_unsharded_bytes_peak",
                                "Most FSDP unsharded parameter bytes alive at once",
                                value=self._meter.peak)
        if self._meter.bound is not None:
            yield GaugeMetricFamily("persia_nn_worker_fsdp_max_unsharded_bytes",
                                    "Bound on FSDP unsharded parameter bytes alive "
                                    "at once (max_unsharded_bytes)",
                                    value=self._meter.bound)

    def describe(self):
        return []

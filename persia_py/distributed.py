"""How the NN workers share the dense tower (as PERSIA's ``persia.distributed``).

* :class:`DDPOption` — every rank keeps a full replica; gradients are allreduced (DDP).
* :class:`FSDPOption` — every rank keeps a shard; parameters are all-gathered per unit
  around its forward and backward, gradients reduce-scattered (PyTorch's FSDP2,
  ``torch.distributed.fsdp.fully_shard``), with a bound on the unsharded bytes alive at
  once (:mod:`persia_py.dense.fsdp_limiter`).

Pass one as ``TrainCtx(..., distributed_option=...)``; the default is ``DDPOption()``.
Embeddings are not touched by either: they live on the parameter servers.

A tower too large to build whole on every rank is built with :func:`build_on_meta`: its
parameters take no memory until ``FSDPOption`` initializes and shards them one unit at a
time, to the values the ordinary construction would have given them.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from persia_py.dense.fsdp_limiter import UnshardedBytesMeter, floor_bytes, unit_bytes
from persia_py.dense.parallel import DenseParallel, FSDPParallel

__all__ = ["DDPOption", "FSDPOption", "build_on_meta", "is_deferred", "materialize"]

logger = logging.getLogger(__name__)

_DDP_OWN_ARGS = {"self", "module", "device_ids", "output_device", "process_group"}
"""DDP arguments TrainCtx sets itself."""


def _default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class DDPOption:
    """A full replica of the dense tower on every rank, gradients allreduced (DDP).

    Args:
        backend: torch.distributed backend; None: ``nccl`` on CUDA, ``gloo`` on CPU.
        **options: keyword arguments of ``torch.nn.parallel.DistributedDataParallel``
            (e.g. ``find_unused_parameters=True``, ``bucket_cap_mb=50``); unknown ones
            are a ValueError. (PERSIA's ``initialization_method`` is gone: ranks join as
            torchrun sets them up.)
    """

    def __init__(self, backend: str | None = None, **options) -> None:
        allowed = set(inspect.signature(nn.parallel.DistributedDataParallel).parameters)
        unknown = sorted(set(options) - (allowed - _DDP_OWN_ARGS))
        if unknown:
            raise ValueError(f"DDPOption: unknown DistributedDataParallel options {unknown}; "
                             f"allowed: {sorted(allowed - _DDP_OWN_ARGS)}")
        self.backend = backend
        self.options = options

    def check(self, model: nn.Module, world_size: int) -> None:
        """Nothing to check before the ranks meet."""

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
             *, shadow_step: Callable[[list, list], None], registry=None) -> DenseParallel:
        """``model`` in DDP when the process group has more than one rank (a model from
        :func:`build_on_meta` is materialized whole first: DDP keeps a full replica)."""
        materialize(model, optimizer, device)
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return DenseParallel(model, model)
        device_ids = [device.index] if device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **self.options)
        return DenseParallel(model, ddp, joinable=ddp)


def direct_children(model: nn.Module) -> list[nn.Module]:
    """The default wrapping policy: each direct child of ``model`` holding parameters."""
    return [child for child in model.children()
            if any(True for _ in child.parameters())]


@dataclass(kw_only=True)
class FSDPOption:
    """Shard the dense tower across the ranks with PyTorch's FSDP2 (``fully_shard``).

    A tower from :func:`build_on_meta` is initialized and sharded one unit at a time
    (no rank holds it whole); any other is sharded from the whole tower each rank built."""

    wrap_policy: Callable[[nn.Module], list[nn.Module]] | tuple[type, ...] | None = None
    """The units: a function from the dense tower to its submodules to shard one by one
    (in the order they run), or module classes (every submodule of those classes,
    outermost only); None: each direct child holding parameters. The tower itself is
    sharded last, taking the parameters left over."""
    reshard_after_forward: bool = True
    """Free each unit's gathered parameters after its forward (gather again for the
    backward): less memory, one more all-gather per unit and step."""
    mixed_precision: torch.distributed.fsdp.MixedPrecisionPolicy | None = None
    """FSDP's ``MixedPrecisionPolicy`` (e.g. bfloat16 parameters and float32 gradient
    reduction on GPU); None: parameters gathered in their own dtype."""
    max_unsharded_bytes: int | None = None
    """The rate limiter: most bytes of gathered parameters alive at once on a rank
    (all-gather buffers in flight and gathered units not yet freed). Prefetching only
    within it; a bound below one unit's need is refused (ValueError); None: the job
    config's ``nn_worker_config.fsdp_max_unsharded_bytes``, and if that is unset too,
    FSDP's own prefetching, unbounded (the peak is still measured)."""
    backend: str | None = None
    """torch.distributed backend; None: ``nccl`` on CUDA, ``gloo`` on CPU."""

    _bound_name = "FSDPOption.max_unsharded_bytes"
    """Where the bound came from, for the messages (not a field)."""

    def __post_init__(self) -> None:
        if self.max_unsharded_bytes is not None and (
                isinstance(self.max_unsharded_bytes, bool)
                or not isinstance(self.max_unsharded_bytes, int)
                or self.max_unsharded_bytes <= 0):
            raise ValueError(f"FSDPOption.max_unsharded_bytes: expected a positive int or "
                             f"None, got {self.max_unsharded_bytes!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"FSDPOption.reshard_after_forward: expected a bool, got "
                             f"{self.reshard_after_forward!r}")

    def with_config_bound(self, config_bound: int | None) -> FSDPOption:
        """This option with ``config_bound`` (``nn_worker_config.fsdp_max_unsharded_bytes``)
        as its bound when it sets none itself: the script's own bound wins. A copy, so
        the caller's option is left as it was written."""
        if self.max_unsharded_bytes is not None or config_bound is None:
            return self
        option = replace(self, max_unsharded_bytes=config_bound)
        option._bound_name = "nn_worker_config.fsdp_max_unsharded_bytes"
        return option

    def units(self, model: nn.Module) -> list[nn.Module]:
        """The submodules this option shards one by one (not the root)."""
        policy = self.wrap_policy
        if policy is None:
            return direct_children(model)
        if isinstance(policy, tuple):
            found: list[nn.Module] = []
            for module in model.modules():
                if module is not model and isinstance(module, policy) and not any(
                        module in set(f.modules()) for f in found):
                    found.append(module)
            return found
        units = list(policy(model))
        names = {id(m) for m in model.modules()}
        if any(id(u) not in names or u is model for u in units):
            raise ValueError("FSDPOption.wrap_policy: must return submodules of the dense "
                             "tower (not the tower itself)")
        return units

    def _param_dtype(self) -> torch.dtype | None:
        return None if self.mixed_precision is None else self.mixed_precision.param_dtype

    def sizes(self, model: nn.Module, world_size: int) -> tuple[list[int], int]:
        """Unsharded bytes of each unit and of the root's own parameters."""
        units = self.units(model)
        in_units = {id(p) for u in units for p in u.parameters()}
        sizes = [unit_bytes(list(u.parameters()), world_size, self._param_dtype())
                 for u in units]
        root = unit_bytes([p for p in model.parameters() if id(p) not in in_units],
                          world_size, self._param_dtype())
        return sizes, root

    def check(self, model: nn.Module, world_size: int) -> None:
        """ValueError if ``max_unsharded_bytes`` is below what one unit alone needs."""
        if self.max_unsharded_bytes is None:
            return
        sizes, root = self.sizes(model, world_size)
        floor = floor_bytes(sizes, root, reshard_after_forward=self.reshard_after_forward)
        if floor > self.max_unsharded_bytes:
            largest = max(sizes, default=0)
            raise ValueError(
                f"{self._bound_name}={self.max_unsharded_bytes} is below the "
                f"{floor} bytes training needs at least: the largest unit is {largest} "
                f"bytes unsharded and is alive twice for a moment (its all-gather buffer "
                f"and the parameters copied out of it), plus the root's own {root} bytes"
                + ("" if self.reshard_after_forward else
                   ", and with reshard_after_forward=False every unit stays gathered")
                + "; raise the bound or split the largest unit with wrap_policy")

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
             *, shadow_step: Callable[[list, list], None], registry=None) -> DenseParallel:
        """Shard ``model`` in place (its parameters become DTensor shards; ``optimizer``
        is pointed at them) when the process group has more than one rank."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not (dist.is_initialized() and dist.get_world_size() > 1):
            logger.info("FSDPOption with one rank: nothing to shard, the model runs whole")
            materialize(model, optimizer, device)
            return DenseParallel(model, model)
        world = dist.get_world_size()
        self.check(model, world)
        sizes, root_bytes = self.sizes(model, world)
        units = self.units(model)
        names = {id(p): name for name, p in model.named_parameters()}
        mp_policy = self.mixed_precision or MixedPrecisionPolicy()

        def shard(unit: nn.Module) -> None:
            fully_shard(unit, reshard_after_forward=self.reshard_after_forward,
                        mp_policy=mp_policy)

        if is_deferred(model):  # initialize and shard unit by unit: one unit whole at a time
            _materialize(model, device, units, shard)
        else:
            for unit in units:
                shard(unit)
        fully_shard(model, mp_policy=mp_policy)  # the root: FSDP keeps it gathered until backward
        _repoint_optimizer(optimizer, names, model)
        meter = UnshardedBytesMeter([*units, model], [*sizes, root_bytes],
                                    bound=self.max_unsharded_bytes, root_bytes=root_bytes)
        if registry is not None:
            meter.register_metrics(registry)
        return FSDPParallel(model, meter, shadow_step)


def _repoint_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str],
                       model: nn.Module) -> None:
    """``fully_shard`` (and :func:`materialize`) replace every parameter by a new one (a
    DTensor shard, or real memory for a meta one); point the optimizer, built over the
    old ones, at the new ones, in the same places, with any state it already holds (e.g.
    Adagrad's initial sums) sharded the same way. State the optimizer made on the meta
    device (its constructor's, over a :func:`build_on_meta` model) has no values to move:
    it is made again by the optimizer's own constructor over the new parameters."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    new = dict(model.named_parameters())
    groups = []
    for group in optimizer.param_groups:
        try:
            groups.append([new[names[id(p)]] for p in group["params"]])
        except KeyError:
            raise ValueError("the dense optimizer holds parameters that are not the "
                             "model's") from None
    fresh = None
    if any(torch.is_tensor(v) and v.is_meta for s in optimizer.state.values()
           for v in s.values()):
        try:
            # Constructor arguments too: e.g. Adagrad fills its sums from its argument
            # initial_accumulator_value, not from the param group's copy.
            fresh = type(optimizer)([{**g, "params": p}
                                     for g, p in zip(optimizer.param_groups, groups)],
                                    **optimizer.defaults)
        except TypeError as exc:
            raise ValueError(
                f"the dense optimizer {type(optimizer).__name__} made state on the meta "
                f"device and cannot be built again from its param groups ({exc}); build it "
                "after materializing, or use an optimizer with lazy state") from exc
    for group, params in zip(optimizer.param_groups, groups):
        for old, param in zip(group["params"], params):
            state = optimizer.state.pop(old, None)
            if not state:
                continue
            if fresh is not None and any(torch.is_tensor(v) and v.is_meta
                                         for v in state.values()):
                optimizer.state[param] = fresh.state[param]
                continue
            optimizer.state[param] = {
                key: (distribute_tensor(value, param.device_mesh, param.placements)
                      if isinstance(param, DTensor) and torch.is_tensor(value)
                      and value.shape == old.shape and value.dim() > 0 else value)
                for key, value in state.items()}
        group["params"] = params


_DEFERRED: weakref.WeakKeyDictionary[nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()
"""Models built by :func:`build_on_meta`, each with the CPU RNG state at its build."""


def build_on_meta(factory: Callable[..., nn.Module], *args, **kwargs) -> nn.Module:
    """``factory(*args, **kwargs)`` with its parameters on the meta device (no memory);
    buffers are built as usual. Pass the model to ``TrainCtx`` as any other, and build the
    dense optimizer over its parameters as usual: with ``FSDPOption`` on several ranks each
    unit is initialized and sharded in turn, so a rank never holds the whole tower (with
    DDP or one rank the model is materialized whole).

    Why not ``with torch.device("meta")``: buffers computed in a constructor (index
    tables, masks) would lose their values. Initialization replays the CPU random stream
    from its state at this call, calling each module's ``reset_parameters()`` in
    registration order; the values equal those of ``factory()`` on the CPU when every
    module holding parameters initializes exactly its own there, as torch's layers do,
    and modules are built in the order they are registered. Refused (ValueError): a
    module holding parameters without ``reset_parameters``, parameters shared between
    modules, and a constructor that draws random numbers itself (the stream could not
    be replayed)."""
    rng = torch.get_rng_state()

    def to_meta(module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter | None:
        # torch calls this in every register_parameter; what it returns is registered.
        if type(param) is nn.Parameter and not param.is_meta:
            return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        return None

    # torch annotates the hook as returning None, but register_parameter registers the
    # parameter a hook returns (as the hook's docstring says).
    handle = nn.modules.module.register_module_parameter_registration_hook(
        to_meta)  # type: ignore[arg-type]
    try:
        model = factory(*args, **kwargs)
    finally:
        handle.remove()
    what = getattr(factory, "__name__", type(model).__name__)
    if not torch.equal(rng, torch.get_rng_state()):
        raise ValueError(f"build_on_meta({what}): the constructor drew random numbers for "
                         "something other than parameters; build it whole instead")
    seen: set[int] = set()
    for module in model.modules():
        own = [p for p in module._parameters.values() if p is not None]
        if own and not callable(getattr(module, "reset_parameters", None)):
            raise ValueError(f"build_on_meta({what}): {type(module).__name__} holds "
                             "parameters but has no reset_parameters() to initialize them")
        for p in own:
            if id(p) in seen:
                raise ValueError(f"build_on_meta({what}): parameters shared between "
                                 "modules are not supported")
            seen.add(id(p))
    _DEFERRED[model] = rng
    return model


def is_deferred(model: nn.Module) -> bool:
    """Whether ``model`` came from :func:`build_on_meta` and is not materialized yet."""
    return model in _DEFERRED


def materialize(model: nn.Module, optimizer: torch.optim.Optimizer,
                device: torch.device) -> None:
    """Give a :func:`build_on_meta` model its whole parameters on ``device`` (as built on
    the CPU) and point ``optimizer`` at them; nothing for any other model."""
    if not is_deferred(model):
        return
    names = {id(p): name for name, p in model.named_parameters()}
    _materialize(model, device, [], lambda unit: None)
    _repoint_optimizer(optimizer, names, model)


def _materialize(model: nn.Module, device: torch.device, units: list[nn.Module],
                 done: Callable[[nn.Module], None]) -> None:
    """Initialize a deferred model's parameters on ``device``, module by module in
    registration order, replaying the RNG from its build; each of ``units`` goes to
    ``done`` (``fully_shard``) as soon as its last module is initialized, so the whole
    parameters of at most one unit (and the root's own) are alive at a time. The
    caller's RNG state is left as it was."""
    rng = _DEFERRED.pop(model)
    modules = list(model.modules())
    index = {id(m): i for i, m in enumerate(modules)}
    ends: dict[int, list[nn.Module]] = {}
    for unit in units:  # pre-order: a unit's modules follow it, contiguously
        last = index[id(unit)] + sum(1 for _ in unit.modules()) - 1
        ends.setdefault(last, []).append(unit)
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng)
        for i, module in enumerate(modules):
            own = [n for n, p in module._parameters.items() if p is not None and p.is_meta]
            for name in own:  # on the CPU: the CPU generator draws the values, as at build
                p = module.get_parameter(name)
                module._parameters[name] = nn.Parameter(torch.empty_like(p, device="cpu"),
                                                        requires_grad=p.requires_grad)
            if own:
                # build_on_meta refused modules that hold parameters without this method
                reset = cast("Callable[[], None]", module.reset_parameters)
                with torch.no_grad():
                    reset()
                if device.type != "cpu":
                    for name in own:
                        p = module.get_parameter(name)
                        module._parameters[name] = nn.Parameter(
                            p.detach().to(device), requires_grad=p.requires_grad)
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)
            for unit in sorted(ends.get(i, ()), key=lambda u: -index[id(u)]):  # inner first
                done(unit)


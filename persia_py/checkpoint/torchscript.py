"""The dense tower compiled by TorchScript, for ``dump_checkpoint(with_jit_model=True)``:
the model itself, or under FSDP the whole tower gathered from the ranks' shards onto
rank 0 as a plain copy (the sharded module cannot be scripted: its parameters are
DTensor shards and FSDP's hooks run around every forward)."""

from __future__ import annotations

import io
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from persia_py.dense.collectives import broadcast_json

_FSDP_ATTRIBUTES = ("_fsdp_use_orig_params", "_is_fsdp_managed_module")
"""What ``fully_shard`` adds to a module's ``__dict__`` besides its composable state."""
_MAX_ERROR_CHARS = 4000
"""Of rank 0's TorchScript error, what the other ranks are told."""
_COMPOSABLE_STATE = "__composable_api_state_key"
"""Prefix of the keys under which ``fully_shard`` keeps its state on the module."""


def torchscript(model: nn.Module) -> bytes:
    """``model`` compiled by ``torch.jit.script``, serialized; ValueError if it cannot be."""
    try:
        scripted = torch.jit.script(model)
    except Exception as exc:  # noqa: BLE001 - TorchScript raises many kinds; all mean "cannot"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"with_jit_model=True: torch.jit.script cannot compile the dense model "
            f"{type(model).__name__} ({reason}); make its forward scriptable (type hints, "
            f"no Python-only constructs) or dump without with_jit_model") from exc
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    return buffer.getvalue()


def torchscript_sharded(model: nn.Module) -> bytes | None:
    """Every rank: the FSDP-sharded ``model`` gathered whole onto rank 0 (in CPU memory:
    the other ranks hold only their shards meanwhile), copied without FSDP and compiled
    there; the bytes on rank 0, None elsewhere. A tower TorchScript cannot compile is a
    ValueError on every rank (rank 0's message), so that no rank goes on to write."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # A model's state dict holds tensors only (ValueType also covers optimizer state).
    full = cast(dict[str, torch.Tensor],
                get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True)))
    result: bytes | None = None
    error: str | None = None
    if dist.get_rank() == 0:
        try:
            result = torchscript(unsharded_copy(model, full))
        except ValueError as exc:
            error = str(exc)[:_MAX_ERROR_CHARS]
    del full
    rank0_error = broadcast_json(error, src=0, what="rank 0's TorchScript error")
    if rank0_error is not None:
        raise ValueError(str(rank0_error))
    return result


def unsharded_copy(model: nn.Module, full_state: dict[str, torch.Tensor]) -> nn.Module:
    """A plain copy of the FSDP-sharded ``model``: each module of its own class (FSDP's
    subclass undone), its attributes but without FSDP's state and without hooks (FSDP's
    are all it has that matter to a forward), the parameters from ``full_state`` (the
    gathered tower, by name) and the buffers on the CPU."""
    from torch.distributed.fsdp import FSDPModule

    def copy(module: nn.Module, prefix: str) -> nn.Module:
        cls = type(module)
        if isinstance(module, FSDPModule):
            cls = next(b for b in cls.__bases__ if b is not FSDPModule)
        attributes = {k: v for k, v in module.__dict__.items()
                      if not k.startswith(_COMPOSABLE_STATE) and k not in _FSDP_ATTRIBUTES}
        attributes.update(nn.Module().__dict__)  # bookkeeping with no hooks registered
        missing = [prefix + n for n, p in module._parameters.items()
                   if p is not None and prefix + n not in full_state]
        if missing:
            raise AssertionError(f"the gathered tower lacks the parameters {missing}")
        attributes.update(
            training=module.training,
            _parameters={n: None if p is None else nn.Parameter(
                full_state[prefix + n], requires_grad=p.requires_grad)
                for n, p in module._parameters.items()},
            _buffers={n: None if b is None else b.cpu() for n, b in module._buffers.items()},
            _non_persistent_buffers_set=set(module._non_persistent_buffers_set),
            _modules={n: None if child is None else copy(child, f"{prefix}{n}.")
                      for n, child in module._modules.items()})
        plain = cls.__new__(cls)
        plain.__dict__.update(attributes)
        return plain

    return copy(model, "")

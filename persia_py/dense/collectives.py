"""Small collectives of the NN ranks, and what joins them (``torch.distributed`` ``Join``).

A rank that ran out of batches while the others train on must take part in every
collective they make, through the :class:`~torch.distributed.algorithms.join.JoinHook`
of each piece that makes one (the dense tower, periodic checkpoints, the agreement to
stop, progressive validation). Those pieces share the group and device rules here.

**Nothing pickled between ranks.** torch's ``*_object`` collectives (``all_gather_object``,
``broadcast_object_list``, ...) pickle what they send and unpickle what they receive, so a
peer, or whoever can write into the group's connections (gloo's are plain TCP, without
authentication), could run code in every rank. The ranks here exchange raw bytes, JSON
and tensors described by JSON instead, each of bounded size: a size over the bound is
refused on every rank alike, before anything is allocated for it
(``tests/test_no_unsafe_deserialization.py`` fails on any ``*_object`` collective).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

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
    mine = torch.from_numpy(array).to(device or torch.device("cpu"))
    sizes = _all_gather_sizes(mine.numel(), mine.device)
    return np.concatenate([t.cpu().numpy() for t in _all_gather_padded(mine, sizes)])


MAX_EXCHANGED_BYTES = 1 << 20
"""Default bound of the bytes (JSON text) one rank sends in one exchange below."""
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}
"""The tensor dtypes :func:`broadcast_tensors` sends, by name."""
_MAX_TENSORS, _MAX_DIMS = 4096, 8


def exchange_device(device: torch.device | None = None) -> torch.device:
    """Where an exchange's tensors live: under NCCL ``device`` (else the current GPU),
    else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return device if device is not None and device.type == "cuda" else torch.device(
            "cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_sizes(size: int, device: torch.device) -> list[int]:
    mine = torch.tensor([size], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(mine) for _ in range(_world_size())]
    dist.all_gather(sizes, mine)
    return [int(s.item()) for s in sizes]


def _all_gather_padded(mine: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Every rank's 1-D tensor (``sizes[r]`` elements), in rank order."""
    padded = torch.zeros(max(sizes), dtype=mine.dtype, device=mine.device)
    padded[:mine.numel()] = mine
    every = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(every, padded)
    return [t[:n] for t, n in zip(every, sizes)]


def _check_sizes(sizes: Mapping[int, int], max_bytes: int, what: str) -> None:
    """The same ValueError on every rank (they all see every rank's size, by rank) when
    one is over ``max_bytes``."""
    over = {r: n for r, n in sizes.items() if not 0 <= n <= max_bytes}
    if over:
        raise ValueError(f"{what}: {', '.join(f'rank {r} sends {n} bytes' for r, n in over.items())}"
                         f", over the bound of {max_bytes} bytes")


def all_gather_bytes(data: bytes, *, max_bytes: int = MAX_EXCHANGED_BYTES,
                     device: torch.device | None = None, what: str = "all_gather_bytes"
                     ) -> list[bytes]:
    """Every rank's ``data``, index = rank."""
    if _world_size() == 1:
        _check_sizes({0: len(data)}, max_bytes, what)
        return [bytes(data)]
    device = exchange_device(device)
    sizes = _all_gather_sizes(len(data), device)
    _check_sizes(dict(enumerate(sizes)), max_bytes, what)
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else \
        torch.zeros(0, dtype=torch.uint8, device=device)
    return [t.cpu().numpy().tobytes() for t in _all_gather_padded(mine, sizes)]


def broadcast_bytes(data: bytes | None, src: int, *, max_bytes: int = MAX_EXCHANGED_BYTES,
                    device: torch.device | None = None, what: str = "broadcast_bytes") -> bytes:
    """Rank ``src``'s ``data`` on every rank (the others' ``data`` is unused)."""
    if _world_size() == 1:
        _check_sizes({src: len(data or b"")}, max_bytes, what)
        return bytes(data or b"")
    device = exchange_device(device)
    mine = dist.get_rank() == src
    size = torch.tensor([len(data or b"") if mine else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    _check_sizes({src: int(size.item())}, max_bytes, what)
    payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if mine and data
               else torch.zeros(int(size.item()), dtype=torch.uint8, device=device))
    dist.broadcast(payload, src=src)
    return payload.cpu().numpy().tobytes()


def _to_json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def _from_json(data: bytes, what: str) -> object:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{what}: not JSON ({type(exc).__name__})") from None


def all_gather_json(value: object, *, max_bytes: int = MAX_EXCHANGED_BYTES,
                    device: torch.device | None = None, what: str = "all_gather_json"
                    ) -> list[object]:
    """Every rank's JSON-able ``value``, index = rank."""
    gathered = all_gather_bytes(_to_json(value), max_bytes=max_bytes, device=device, what=what)
    return [_from_json(data, f"{what} from rank {r}") for r, data in enumerate(gathered)]


def broadcast_json(value: object, src: int, *, max_bytes: int = MAX_EXCHANGED_BYTES,
                   device: torch.device | None = None, what: str = "broadcast_json") -> object:
    """Rank ``src``'s JSON-able ``value`` on every rank (the others' ``value`` is unused)."""
    mine = _world_size() == 1 or dist.get_rank() == src
    data = broadcast_bytes(_to_json(value) if mine else None, src, max_bytes=max_bytes,
                           device=device, what=what)
    return _from_json(data, f"{what} from rank {src}")


def broadcast_tensors(parts: Sequence[Sequence[torch.Tensor]] | None, src: int, *, max_bytes: int,
                      device: torch.device, what: str = "broadcast_tensors"
                      ) -> list[list[torch.Tensor]]:
    """Rank ``src``'s lists of tensors on every rank, on ``device`` (the others' ``parts``
    is unused): their dtypes and shapes as JSON, then each tensor's values; at most
    ``max_bytes`` in all."""
    mine = _world_size() == 1 or dist.get_rank() == src
    if mine and parts is None:
        raise ValueError(f"{what}: rank {src} sends, so its parts cannot be None")
    sent = parts if mine else None
    shapes = None if sent is None else [
        [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in part] for part in sent]
    header = broadcast_json(shapes, src, device=device, what=f"{what} (dtypes and shapes)")
    specs = _tensor_specs(header, max_bytes, f"{what} from rank {src}")
    received = []
    for p, part_specs in enumerate(specs):
        part = []
        for i, (dtype, shape) in enumerate(part_specs):
            tensor = (sent[p][i].to(device).contiguous() if sent is not None
                      else torch.empty(shape, dtype=dtype, device=device))
            if _world_size() > 1:
                dist.broadcast(tensor, src=src)
            part.append(tensor)
        received.append(part)
    return received


def _tensor_specs(header: object, max_bytes: int, what: str
                  ) -> list[list[tuple[torch.dtype, list[int]]]]:
    """``header`` checked whole: lists of ``[dtype name, shape]``, in all at most
    ``_MAX_TENSORS`` tensors of at most ``_MAX_DIMS`` dimensions and ``max_bytes``."""
    if not isinstance(header, list) or not all(isinstance(p, list) for p in header):
        raise ValueError(f"{what}: expected lists of [dtype, shape], got {str(header)[:200]}")
    specs: list[list[tuple[torch.dtype, list[int]]]] = []
    num_tensors, num_bytes = 0, 0
    for part in header:
        specs.append([])
        for entry in part:
            num_tensors += 1
            if (not isinstance(entry, list) or len(entry) != 2 or entry[0] not in _DTYPES
                    or not isinstance(entry[1], list) or len(entry[1]) > _MAX_DIMS
                    or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 40
                               for n in entry[1])):
                raise ValueError(f"{what}: {str(entry)[:200]} is not [dtype, shape] with a "
                                 f"dtype of {sorted(_DTYPES)} and at most {_MAX_DIMS} sizes")
            dtype = _DTYPES[entry[0]]
            num_bytes += int(np.prod(entry[1], dtype=np.float64)) * dtype.itemsize
            specs[-1].append((dtype, entry[1]))
    if num_tensors > _MAX_TENSORS or num_bytes > max_bytes:
        raise ValueError(f"{what}: {num_tensors} tensors of {num_bytes} bytes, over the "
                         f"bound of {_MAX_TENSORS} tensors and {max_bytes} bytes")
    return specs

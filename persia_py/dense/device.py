"""The torch device of an NN-worker process: ``cuda:LOCAL_RANK`` where CUDA is available.

torchrun starts one process per GPU and tells each its ``LOCAL_RANK``; the contexts
(:class:`~persia_py.ctx.TrainCtx`, :class:`~persia_py.ctx.InferCtx`) take that GPU by
themselves. An explicit ``device_id`` wins; to run on the CPU on a machine with GPUs, hide
them (``CUDA_VISIBLE_DEVICES=``). Parameter servers, embedding workers and data loaders
never use a GPU.
"""

from __future__ import annotations

import torch


def pick_device(device_id: int | None, *, local_rank: int, cuda_available: bool,
                num_cuda_devices: int) -> torch.device:
    """The device a context runs its model on.

    ``device_id`` given: ``cuda:device_id`` (an error naming it when CUDA is absent or
    the GPU does not exist). None: ``cuda:local_rank`` when CUDA is available (an error
    naming ``LOCAL_RANK`` when this machine has fewer GPUs than ranks), else the CPU."""
    if device_id is not None:
        if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
            raise TypeError(f"device_id: expected a CUDA device index (an int >= 0) or None "
                            f"for the automatic choice, got {device_id!r}")
        if not cuda_available:
            raise ValueError(f"device_id={device_id}: CUDA is not available in this process "
                             f"(torch {torch.__version__}); pass device_id=None to run on "
                             f"the CPU")
        if device_id >= num_cuda_devices:
            raise ValueError(f"device_id={device_id}: this machine has {num_cuda_devices} "
                             f"visible CUDA device(s)")
        return torch.device("cuda", device_id)
    if not cuda_available:
        return torch.device("cpu")
    if not 0 <= local_rank < num_cuda_devices:
        raise ValueError(
            f"LOCAL_RANK={local_rank} but this machine has {num_cuda_devices} visible CUDA "
            f"device(s): start at most one NN-worker rank per GPU (--nproc-per-node "
            f"{num_cuda_devices}), or pass device_id, or hide the GPUs "
            f"(CUDA_VISIBLE_DEVICES=) to train on the CPU")
    return torch.device("cuda", local_rank)


def device_of_this_process(device_id: int | None, local_rank: int) -> torch.device:
    """:func:`pick_device` with this process's CUDA state; makes a chosen GPU current (as
    NCCL and ``torch.cuda`` defaults expect)."""
    available = torch.cuda.is_available()
    device = pick_device(device_id, local_rank=local_rank, cuda_available=available,
                         num_cuda_devices=torch.cuda.device_count() if available else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device

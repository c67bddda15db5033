"""Pooling a slot's looked-up rows into what the model sees (sum / mean / raw sequence):
one vectorized op over the batch's distinct rows, so that backward gives one gradient per
distinct id (the gradient the parameter servers apply)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from persia_py.workers.slots import SlotRows, pooled_by_kernel

__all__ = ["pool_slot"]


def pool_slot(rows: torch.Tensor, slot: SlotRows) -> torch.Tensor:
    """The model-facing tensor of one slot: ``[batch, dim]`` pooled or ``[batch, L, dim]`` raw.

    A hash-stacked id has ``hash_stack_rounds`` consecutive index entries whose rows are
    summed into its embedding; pooling, ``sqrt_scaling`` and raw positions count ids.
    ``rows`` float32, or float16 as they arrived (pooled by :class:`_Bag` as they are on
    the CPU where :func:`pooled_by_kernel` says so, widened first elsewhere).
    """
    lengths = torch.from_numpy(slot.lengths.astype(np.int64))
    index = torch.from_numpy(slot.index)
    batch_size = lengths.numel()
    rounds = slot.hash_stack_rounds
    kernel = pooled_by_kernel(slot.pooling, index.numel(), batch_size)
    if rows.dtype == torch.float16 and not (kernel and rows.device.type == "cpu"):
        rows = rows.float()
    entries = lengths * rounds  # index entries per sample
    if slot.pooling == "raw":
        fixed = slot.sample_fixed_size
        sample = torch.repeat_interleave(torch.arange(batch_size), entries)
        starts = torch.cumsum(entries, 0) - entries
        position = torch.div(torch.arange(index.numel()) - starts[sample], rounds,
                             rounding_mode="floor")
        flat = rows.new_zeros(batch_size * fixed, rows.shape[1])
        flat = flat.index_add(0, sample * fixed + position, rows[index])
        return flat.view(batch_size, fixed, rows.shape[1])
    if rounds == 1 and index.numel() == batch_size and bool((lengths == 1).all()):
        # One id per sample: sum, mean and sqrt scaling all give its row, and
        # index_select's backward (one index_add) is cheaper than embedding_bag's.
        return rows.index_select(0, index)
    offsets = torch.cumsum(entries, 0) - entries
    mode = slot.pooling
    bag = _Bag.apply if kernel else _native_bag
    if not slot.sqrt_scaling and (mode == "sum" or rounds == 1):
        return bag(rows, index, offsets, entries, mode, None)
    # A per-entry weight of the sample: 1/sqrt(n) for sqrt_scaling, 1/n for mean.
    count = lengths.clamp(min=1).to(torch.float32 if rows.dtype == torch.float16 else rows.dtype)
    scale = count.rsqrt() if slot.sqrt_scaling else torch.ones_like(count)
    if mode == "mean":
        scale = scale / count
    weights = torch.repeat_interleave(scale, entries)
    return bag(rows, index, offsets, entries, "sum", weights)


_NO_WEIGHTS = np.zeros(0, np.float32)


def _native_bag(rows, index, offsets, entries, mode, weights):
    return F.embedding_bag(index, rows, offsets, mode=mode, per_sample_weights=weights)


def _sum_entry_grads(grad: np.ndarray, index: np.ndarray, entries: np.ndarray,
                     weights: np.ndarray, mean: bool, out: np.ndarray) -> None:
    """:func:`persia_py.workers.entry_grads.sum_entry_grads`, imported on the first call:
    numba comes with it, and a rank whose slots never take this path does not import it."""
    from persia_py.workers.entry_grads import sum_entry_grads

    sum_entry_grads(grad, index, entries, weights, mean, out)


def _pool_halves(rows: torch.Tensor, index: torch.Tensor, entries: torch.Tensor,
                 weights: torch.Tensor | None, mean: bool) -> torch.Tensor:
    """The pooled float32 ``[batch, dim]`` of float16 ``rows``
    (:func:`persia_py.workers.half_pooling.pool_halves`, imported as
    :func:`_sum_entry_grads` imports its kernel)."""
    from persia_py.workers.half_pooling import pool_halves

    out = torch.empty(entries.numel(), rows.shape[1], dtype=torch.float32)
    pool_halves(rows.numpy().view(np.int16), index.numpy(), entries.numpy(),
                _NO_WEIGHTS if weights is None else weights.contiguous().numpy(), mean,
                out.numpy())
    return out


def _entry_grads_as_halves(grad: np.ndarray, index: np.ndarray, entries: np.ndarray,
                           weights: np.ndarray, mean: bool, num_rows: int) -> torch.Tensor:
    """The float16 gradient of float16 rows
    (:func:`persia_py.workers.half_pooling.entry_grads_as_halves`)."""
    from persia_py.workers.half_pooling import entry_grads_as_halves

    out = torch.empty(num_rows, grad.shape[1], dtype=torch.float16)
    entry_grads_as_halves(grad, index, entries, weights, mean,
                          np.empty((num_rows, grad.shape[1]), np.float32),
                          out.numpy().view(np.int16))
    return out


class _Bag(torch.autograd.Function):
    """``F.embedding_bag`` whose backward adds each entry's gradient onto its row in one
    pass (:func:`_sum_entry_grads`; ``index_add_`` of the gathered gradients off the CPU):
    the built-in dense backward sorts the index and adds row by row, several times slower
    with many entries per sample, and gathering a gradient per entry first writes and
    reads an array ``ids per sample`` times the gradient's size (docs/benchmarks.md).
    float16 rows (CPU) are pooled as they are and get a float16 gradient
    (:mod:`persia_py.workers.half_pooling`): no float32 copy of either."""

    @staticmethod
    def forward(ctx, rows, index, offsets, entries, mode, weights):
        ctx.save_for_backward(index, entries, weights)
        ctx.mode, ctx.num_rows = mode, rows.shape[0]
        ctx.halves = rows.dtype == torch.float16
        if ctx.halves:
            return _pool_halves(rows.detach(), index, entries, weights, mode == "mean")
        return F.embedding_bag(index, rows, offsets, mode=mode, per_sample_weights=weights)

    @staticmethod
    def backward(ctx, grad):
        index, entries, weights = ctx.saved_tensors
        if ctx.halves:
            rows_grad = _entry_grads_as_halves(
                grad.detach().float().contiguous().numpy(), index.numpy(), entries.numpy(),
                _NO_WEIGHTS if weights is None else weights.contiguous().numpy(),
                ctx.mode == "mean", ctx.num_rows)
        elif grad.device.type == "cpu" and grad.dtype == torch.float32:
            # Not zeroed here: the kernel sets every row (a pass over ~1 MB a slot saved).
            rows_grad = grad.new_empty(ctx.num_rows, grad.shape[1])
            _sum_entry_grads(grad.detach().contiguous().numpy(), index.numpy(), entries.numpy(),
                             _NO_WEIGHTS if weights is None else weights.contiguous().numpy(),
                             ctx.mode == "mean", rows_grad.numpy())
        else:
            rows_grad = _index_add_entry_grads(grad.new_zeros(ctx.num_rows, grad.shape[1]),
                                               grad, index, entries, weights, ctx.mode)
        return rows_grad, None, None, None, None, None


def _index_add_entry_grads(rows_grad: torch.Tensor, grad: torch.Tensor, index: torch.Tensor,
                           entries: torch.Tensor, weights: torch.Tensor | None,
                           mode: str) -> torch.Tensor:
    """:func:`_sum_entry_grads` onto ``rows_grad`` (zeros) in torch ops, for gradients off
    the CPU or not float32: each entry's gradient gathered, then one ``index_add_``."""
    sample = torch.repeat_interleave(torch.arange(entries.numel(), device=grad.device),
                                     entries)
    per_entry = grad.index_select(0, sample)  # each entry gets its sample's gradient
    if weights is not None:
        per_entry = per_entry * weights.unsqueeze(1)
    elif mode == "mean":
        per_entry = per_entry / entries.clamp(min=1).to(grad.dtype)[sample].unsqueeze(1)
    return rows_grad.index_add_(0, index, per_entry)

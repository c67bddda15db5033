"""NN-worker pooling: sum / mean / sqrt-scaled / raw, and one gradient per distinct id."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from persia_py.workers import pooling as pooling_module
from persia_py.workers import slots as slots_module
from persia_py.workers.embedding_worker import SlotRows
from persia_py.workers.pooling import pool_slot
from persia_py.workers.slots import pooled_by_kernel

ROWS = np.arange(12, dtype=np.float32).reshape(4, 3)  # 4 distinct ids, dim 3
INDEX = np.array([0, 1, 1, 3, 2, 0], np.int64)  # id occurrences -> rows
LENGTHS = np.array([3, 0, 2, 1], np.int32)  # 4 samples, one empty


def _slot(pooling: str, sqrt_scaling: bool = False, fixed: int = 3) -> SlotRows:
    return SlotRows("s", ROWS, INDEX, LENGTHS, pooling, sqrt_scaling, fixed)


def _reference(pooling: str, sqrt_scaling: bool = False) -> np.ndarray:
    out, start = [], 0
    for n in LENGTHS:
        rows = ROWS[INDEX[start:start + n]]
        start += n
        if n == 0:
            out.append(np.zeros(3, np.float32))
            continue
        pooled = rows.sum(0)
        if pooling == "mean":
            pooled = pooled / n
        if sqrt_scaling:
            pooled = pooled / np.sqrt(n)
        out.append(pooled)
    return np.stack(out)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("sqrt_scaling", [False, True])
def test_pooling_matches_reference(pooling: str, sqrt_scaling: bool) -> None:
    got = pool_slot(torch.from_numpy(ROWS), _slot(pooling, sqrt_scaling)).numpy()
    np.testing.assert_allclose(got, _reference(pooling, sqrt_scaling), rtol=1e-6)


def test_raw_sequence_is_padded_in_order() -> None:
    got = pool_slot(torch.from_numpy(ROWS), _slot("raw", fixed=3)).numpy()
    assert got.shape == (4, 3, 3)
    np.testing.assert_array_equal(got[0], ROWS[[0, 1, 1]])
    np.testing.assert_array_equal(got[1], 0)
    np.testing.assert_array_equal(got[2, :2], ROWS[[3, 2]])
    np.testing.assert_array_equal(got[2, 2], 0)
    np.testing.assert_array_equal(got[3, 0], ROWS[0])


@pytest.mark.parametrize("pooling", ["sum", "raw"])
def test_backward_gives_one_summed_gradient_per_distinct_id(pooling: str) -> None:
    rows = torch.from_numpy(ROWS.copy()).requires_grad_(True)
    pool_slot(rows, _slot(pooling)).sum().backward()
    # Each distinct row's gradient counts its occurrences: row 0 twice, 1 twice, 2 and 3 once.
    np.testing.assert_array_equal(rows.grad.numpy(), np.repeat([[2.0], [2.0], [1.0], [1.0]], 3, 1))


@pytest.mark.parametrize("native_up_to", [0, 1000], ids=["index_add", "torch"])
@pytest.mark.parametrize("pooling, sqrt_scaling, rounds", [
    ("sum", False, 1), ("mean", False, 1), ("sum", True, 1), ("mean", True, 1),
    ("sum", False, 2), ("mean", False, 2)])
def test_backward_matches_embedding_bag_autograd(pooling: str, sqrt_scaling: bool,
                                                 rounds: int, native_up_to: int,
                                                 monkeypatch) -> None:
    # Both backward paths: the scatter of _Bag and torch's own.
    monkeypatch.setattr(slots_module, "FEW_ENTRIES_PER_SAMPLE", native_up_to)
    index = np.repeat(INDEX, rounds) if rounds > 1 else INDEX
    slot = SlotRows("s", ROWS, index, LENGTHS, pooling, sqrt_scaling, 3, rounds)
    upstream = torch.linspace(-1, 1, 12).reshape(4, 3)
    rows = torch.from_numpy(ROWS.copy()).requires_grad_(True)
    (pool_slot(rows, slot) * upstream).sum().backward()
    # The same pooling through F.embedding_bag's own backward.
    lengths = torch.from_numpy(LENGTHS.astype(np.int64)) * rounds
    count = torch.from_numpy(LENGTHS.astype(np.float32)).clamp(min=1)
    scale = (count.rsqrt() if sqrt_scaling else torch.ones(4)) / (
        count if pooling == "mean" else 1)
    expected_rows = torch.from_numpy(ROWS.copy()).requires_grad_(True)
    pooled = torch.nn.functional.embedding_bag(
        torch.from_numpy(index), expected_rows, torch.cumsum(lengths, 0) - lengths, mode="sum",
        per_sample_weights=torch.repeat_interleave(scale, lengths))
    (pooled * upstream).sum().backward()
    np.testing.assert_allclose(rows.grad.numpy(), expected_rows.grad.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("pooling, sqrt_scaling", [("sum", False), ("mean", True)])
def test_one_id_per_sample_matches_embedding_bag(pooling: str, sqrt_scaling: bool) -> None:
    # The one-entry-per-sample shortcut (index_select) gives embedding_bag's values and
    # gradients, duplicates included.
    index = np.array([2, 0, 2, 1, 3], np.int64)
    slot = SlotRows("s", ROWS, index, np.ones(5, np.int32), pooling, sqrt_scaling, 3)
    upstream = torch.linspace(-1, 1, 15).reshape(5, 3)
    rows = torch.from_numpy(ROWS.copy()).requires_grad_(True)
    got = pool_slot(rows, slot)
    (got * upstream).sum().backward()
    expected_rows = torch.from_numpy(ROWS.copy()).requires_grad_(True)
    pooled = torch.nn.functional.embedding_bag(torch.from_numpy(index), expected_rows,
                                               torch.arange(5), mode=pooling)
    (pooled * upstream).sum().backward()
    np.testing.assert_array_equal(got.detach().numpy(), pooled.detach().numpy())
    np.testing.assert_allclose(rows.grad.numpy(), expected_rows.grad.numpy(), rtol=1e-6)


@pytest.mark.parametrize("mode, weighted", [("sum", False), ("mean", False), ("sum", True)])
def test_the_one_pass_backward_adds_as_index_add_does(mode: str, weighted: bool) -> None:
    """The CPU backward (a numba pass) gives bit for bit what gathering each entry's
    gradient and one ``index_add_`` onto zeros give (the path off the CPU), empty samples
    and rows no entry names included, whatever its output array held before."""
    rng = np.random.default_rng(7)
    entries = torch.from_numpy(rng.integers(0, 40, 300))
    num_rows = 8000  # more than the ~6,000 entries: some rows get none
    index = torch.from_numpy(rng.integers(0, num_rows, int(entries.sum())))
    grad = torch.from_numpy(rng.normal(size=(300, 16)).astype(np.float32))
    weights = torch.from_numpy(rng.random(index.numel()).astype(np.float32)) if weighted else None
    fused = torch.full((num_rows, 16), float("nan"))  # never read: every row is set
    pooling_module._sum_entry_grads(grad.numpy(), index.numpy(), entries.numpy(),
                                    weights.numpy() if weighted else pooling_module._NO_WEIGHTS,
                                    mode == "mean", fused.numpy())
    assert not bool(torch.isin(torch.arange(num_rows), index).all())
    gathered = pooling_module._index_add_entry_grads(torch.zeros(num_rows, 16), grad, index,
                                                     entries, weights, mode)
    assert torch.equal(fused, gathered)


def test_the_one_pass_backward_refuses_an_index_that_does_not_fit() -> None:
    grad, out = np.ones((2, 4), np.float32), np.zeros((3, 4), np.float32)
    entries = np.array([1, 2])
    with pytest.raises(ValueError, match="do not add up"):
        pooling_module._sum_entry_grads(grad, np.array([0, 1]), entries,
                                        pooling_module._NO_WEIGHTS, False, out)
    with pytest.raises(ValueError, match="past the rows"):
        pooling_module._sum_entry_grads(grad, np.array([0, 1, 3]), entries,
                                        pooling_module._NO_WEIGHTS, False, out)


# -- float16 rows as they arrived -------------------------------------------------------

def _many_entries_slot(rng: np.random.Generator, rows: np.ndarray, pooling: str,
                       sqrt_scaling: bool, rounds: int) -> SlotRows:
    lengths = rng.integers(0, 12, 200).astype(np.int32)  # ~5.5 ids a sample, empty ones too
    lengths[:3] = [0, 11, 1]
    index = rng.integers(0, rows.shape[0], int(lengths.sum()) * rounds)
    slot = SlotRows("s", rows, index, lengths, pooling, sqrt_scaling, 3, rounds)
    assert pooled_by_kernel(pooling, index.size, lengths.size)
    return slot


@pytest.mark.parametrize("pooling, sqrt_scaling, rounds", [
    ("sum", False, 1), ("mean", False, 1), ("sum", True, 1), ("mean", True, 1),
    ("sum", False, 2), ("mean", False, 2)])
def test_float16_rows_pool_and_backpropagate_as_their_widened_rows(
        pooling: str, sqrt_scaling: bool, rounds: int) -> None:
    """float16 rows pooled as they are give what their float32 widening gives, and a
    float16 gradient equal to the float32 one rounded to nearest (what the wire's cast
    made of it): bit for bit unweighted; weighted sums round once per entry, as
    embedding_bag's fused multiply-add on x86 does."""
    rng = np.random.default_rng(11)
    halves = (rng.normal(size=(500, 16)) * 0.1).astype(np.float16)
    halves[7, 3] = np.float16(60000)  # large values widen exactly as well
    slot = _many_entries_slot(rng, halves, pooling, sqrt_scaling, rounds)
    upstream = torch.from_numpy(rng.normal(size=(200, 16)).astype(np.float32) * 3e4)
    got_rows = torch.from_numpy(halves.copy()).requires_grad_(True)
    got = pool_slot(got_rows, slot)
    (got * upstream).sum().backward()
    wide_rows = torch.from_numpy(halves.astype(np.float32)).requires_grad_(True)
    wide = pool_slot(wide_rows, slot)
    (wide * upstream).sum().backward()
    assert got.dtype == torch.float32 and got_rows.grad.dtype == torch.float16
    if sqrt_scaling or (pooling == "mean" and rounds > 1):
        np.testing.assert_allclose(got.detach().numpy(), wide.detach().numpy(), rtol=1e-6,
                                   atol=1e-7)
    else:
        assert torch.equal(got, wide)
    # Some sums pass float16's range: infinity, as the cast to the wire gives.
    assert bool(got_rows.grad.isinf().any()) and bool(got_rows.grad.isfinite().any())
    assert torch.equal(got_rows.grad, wide_rows.grad.half())


@pytest.mark.parametrize("pooling, lengths", [("raw", [3, 0, 2, 1]), ("sum", [3, 0, 2, 1]),
                                              ("sum", [1, 1, 1, 1])],
                         ids=["raw", "few-entries", "one-id"])
def test_float16_rows_pooled_by_torch_are_widened_first(pooling: str, lengths: list) -> None:
    lengths = np.array(lengths, np.int32)
    index = INDEX[:int(lengths.sum())]
    slot = SlotRows("s", ROWS.astype(np.float16), index, lengths, pooling, False, 3)
    assert not pooled_by_kernel(pooling, index.size, lengths.size)
    halves = torch.from_numpy(ROWS.astype(np.float16)).requires_grad_(True)
    pool_slot(halves, slot).sum().backward()
    wide = torch.from_numpy(ROWS.copy()).requires_grad_(True)
    expected = pool_slot(wide, SlotRows("s", ROWS, index, lengths, pooling, False, 3))
    expected.sum().backward()
    assert halves.grad.dtype == torch.float16
    assert torch.equal(halves.grad, wide.grad.half())


def test_float16_pooling_refuses_an_index_that_does_not_fit() -> None:
    halves = torch.zeros(3, 4, dtype=torch.float16)
    for index, match in (([0, 1], "do not add up"), ([0, 1, 3], "past the rows"),
                         ([0, 1, -1], "past the rows")):
        slot = SlotRows("s", halves.numpy(), np.array(index), np.array([1, 2], np.int32),
                        "sum", False, 3)
        with pytest.MonkeyPatch.context() as patch, pytest.raises(ValueError, match=match):
            patch.setattr(slots_module, "FEW_ENTRIES_PER_SAMPLE", 0)
            pool_slot(halves, slot)

"""NN-worker pooling: sum / mean / sqrt-scaled / raw, and one gradient per distinct id."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from persia_py.workers.embedding_worker import SlotRows
from persia_py.workers.nn_worker import pool_slot

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

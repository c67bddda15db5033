"""``persia_py.wire.finite.all_finite``: what the embedding workers and parameter servers
check every gradient array with, float16 by its exponent bits; ``row_types.all_finite``,
stored rows of each type; and the NN worker's check of its dense gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from persia_py.servers import row_types
from persia_py.wire.finite import all_finite


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_one_nan_or_infinity_anywhere_is_found(dtype) -> None:
    finite = np.random.default_rng(0).normal(size=(37, 5)).astype(dtype)
    finite[0, 0], finite[1, 1] = np.finfo(dtype).max, -np.finfo(dtype).smallest_subnormal
    assert all_finite(finite) and all_finite(finite[:, 1:])  # a strided view too
    for bad in (np.nan, np.inf, -np.inf):
        for at in ((0, 0), (36, 4), (20, 2)):
            array = finite.copy()
            array[at] = bad
            assert not all_finite(array), (bad, at)
    assert all_finite(np.zeros((0, 5), dtype))



def _bits_of(value: float, row_dtype: str):
    """``value`` as one stored weight of ``row_dtype`` (NaN and infinities included)."""
    if row_dtype == "bfloat16":
        return np.uint16(np.float32(value).view(np.uint32) >> 16)
    return row_types.numpy_dtype(row_dtype).type(value)


@pytest.mark.parametrize("row_dtype", ["float32", "float16", "bfloat16"])
def test_stored_rows_of_every_type_are_checked_by_their_bits(row_dtype) -> None:
    """What imports and checkpoint loads check rows with (``row_types.all_finite``)."""
    values = np.random.default_rng(1).normal(size=(41, 6)).astype(np.float32)
    values[0, 0] = 65504.0 if row_dtype == "float16" else 3e38  # the largest finite ones
    rows = row_types.to_stored(values, row_dtype)
    assert row_types.all_finite(rows, row_dtype) and row_types.all_finite(rows[:, 2:], row_dtype)
    for bad in (np.nan, np.inf, -np.inf):
        for at in ((0, 0), (40, 5), (17, 3)):
            stored = rows.copy()
            stored[at] = _bits_of(bad, row_dtype)
            assert not row_types.all_finite(stored, row_dtype), (bad, at)


def test_dense_gradients_are_finite_unless_an_element_is_not() -> None:
    from persia_py.dense.parallel import _local_grads_finite
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (4, 3, 0)]
    optimizer = torch.optim.SGD(params, lr=0.1)
    params[0].grad = torch.tensor([1.0, -2.0, 0.5, 3.0])
    assert _local_grads_finite(optimizer)  # the second has no gradient, the third no elements
    params[1].grad = torch.tensor([3e38, 3e38, -1.0])  # finite, though its sum overflows
    assert _local_grads_finite(optimizer)
    for bad in (float("nan"), float("inf"), -float("inf")):
        params[1].grad = torch.tensor([1.0, bad, 2.0])
        assert not _local_grads_finite(optimizer), bad

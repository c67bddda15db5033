"""``persia_py.wire.finite.all_finite``: what the embedding workers and parameter servers
check every gradient array with, float16 by its exponent bits."""

from __future__ import annotations

import numpy as np
import pytest

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

"""Row storage types: float16/bfloat16 conversions, stochastic rounding, and tables that
store their rows in them (lookups, optimizer steps, imports)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from persia_py.config import ConfigError, embedding_config_from_dict
from persia_py.config.optimizer import AdagradConfig, AdamConfig, SGDConfig
from persia_py.servers import row_types
from persia_py.servers.call_memory import LookupAnswer
from persia_py.servers.row_types import (
    NEAREST,
    bf16_to_float,
    f16_to_float,
    float_to_bf16,
    float_to_f16,
)
from persia_py.servers.storage import EmbeddingTable

ALL_RAND = np.arange(1 << 16, dtype=np.uint32)


F16 = (float_to_f16, f16_to_float)
BF16 = (float_to_bf16, bf16_to_float)


def _rounded(value: float, fmt: tuple, rands: np.ndarray) -> np.ndarray:
    """``value`` rounded with each of ``rands``, read back as float64."""
    x = np.float32(value)
    to_bits, to_float = fmt
    return np.array([to_float(to_bits(x, r)) for r in rands], np.float64)


def test_float16_patterns_decode_exactly_and_round_to_nearest_like_numpy() -> None:
    bits = np.arange(1 << 16, dtype=np.uint16)
    finite = bits[np.isfinite(bits.view(np.float16))]
    decoded = row_types.to_float32(finite.view(np.float16)[:, None], "float16")[:, 0]
    assert np.array_equal(decoded, finite.view(np.float16).astype(np.float32))
    # Nearest as numpy rounds, but ties go away from zero (numpy: to even).
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(20000) * np.exp(rng.uniform(-20, 11, 20000))).astype(np.float32)
    values = values[np.abs(values) < 65000]  # past it float16 saturates where numpy overflows
    ours = row_types.to_stored(values[:, None], "float16")[:, 0].astype(np.float64)
    theirs = values.astype(np.float16).astype(np.float64)
    other = ours != theirs
    assert np.count_nonzero(other) < 10
    exact = values[other].astype(np.float64)
    assert np.array_equal(np.abs(ours[other] - exact), np.abs(theirs[other] - exact))
    assert (np.abs(ours[other]) > np.abs(theirs[other])).all()


def test_bfloat16_keeps_the_upper_half_of_float32_and_its_range() -> None:
    values = np.array([[1.0, -3.5, 1e30, -1e-30, 0.0, 1.00390625]], np.float32)
    bits = row_types.to_stored(values, "bfloat16")
    assert bits.dtype == np.uint16 and bits[0, 0] == 0x3F80
    widened = row_types.to_float32(bits, "bfloat16")
    assert np.array_equal(widened, (bits.astype(np.uint32) << 16).view(np.float32))
    np.testing.assert_allclose(widened, values, rtol=2.0**-8)  # 1e30 stays finite
    assert widened[0, 5] == np.float32(1.0078125)  # a tie rounds away from zero


@pytest.mark.parametrize(("fmt", "value"), [  # (F16, 3.1e-6): a float16 subnormal
    (F16, 1.0001), (F16, -0.30001), (F16, 3.1e-6), (F16, 1234.56),
    (BF16, 1.0001), (BF16, -7.77e-3), (BF16, 3.0e20),
], ids=lambda v: f"{v:g}" if isinstance(v, float) else "float16" if v is F16 else "bfloat16")
def test_stochastic_rounding_is_exact_on_average(fmt, value) -> None:
    """Over every 16-bit draw, the mean of the rounded values is the value itself (to the
    draw's resolution: float16 uses its top 13 bits, bfloat16 all 16), where rounding to
    nearest is off by up to half a unit."""
    rounded = _rounded(value, fmt, ALL_RAND)
    lo, hi = rounded.min(), rounded.max()
    assert lo < np.float32(value) < hi and set(np.unique(rounded)) == {lo, hi}
    resolution = 2.0**-13 if fmt is F16 else 2.0**-16
    assert abs(rounded.mean() - np.float64(np.float32(value))) <= (hi - lo) * resolution
    nearest = _rounded(value, fmt, np.array([NEAREST]))[0]
    assert nearest == (lo if value - lo < hi - value else hi)


def test_float16_rounding_saturates_at_its_largest_value() -> None:
    for value in (65519.0, 65520.0, 1e6, -1e9):
        got = _rounded(value, F16, np.array([0, 0xFFFF], np.uint32))
        assert np.array_equal(np.abs(got), [65504.0, 65504.0])


@njit
def _round_each(values: np.ndarray, rands: np.ndarray, out: np.ndarray) -> None:
    """float_to_f16 in a loop as the update kernels run it (vectorized, branch-free)."""
    for i in range(values.shape[0]):
        out[i] = float_to_f16(values[i], rands[i])


def _stochastic_f16_reference(values: np.ndarray, rands: np.ndarray) -> np.ndarray:
    """The rule :func:`float_to_f16` documents, in float64 numpy: the float16 below
    ``|value|`` or the one above, the one above when the dropped fraction plus the draw's
    top 13 bits (as a fraction) reaches one; 0 or 2**-24 below 2**-24 (the sum taken in
    float32, as the kernel does); saturated at 65504."""
    a = np.abs(values.astype(np.float64))
    exponent = np.frexp(a)[1] - 1
    ulp = np.exp2(np.maximum(exponent, -14) - 10.0)
    lo = np.floor(a / ulp) * ulp
    draw = (rands >> 3).astype(np.float64) / 2.0**13
    out = np.where((a - lo) / ulp + draw >= 1.0, lo + ulp, lo)
    tiny = np.abs(values) * np.float32(2.0**24) + draw.astype(np.float32)
    out = np.where(a < 2.0**-24, np.where(tiny >= np.float32(1.0), 2.0**-24, 0.0), out)
    return np.copysign(np.minimum(out, 65504.0), values)


def test_float16_stochastic_rounding_follows_its_rule_in_every_range() -> None:
    """Normal, subnormal, below float16's least value, and past its largest, each with
    random draws and the extreme ones."""
    rng = np.random.default_rng(5)
    n = 400_000
    values = (rng.standard_normal(n) * np.exp2(rng.uniform(-30, 18, n))).astype(np.float32)
    values[:6] = [0.0, -0.0, 2.0**-24, -(2.0**-25), 65504.0, 65519.0]
    rands = rng.integers(0, 1 << 16, n).astype(np.uint32)
    rands[6:1000] = 0
    rands[1000:2000] = 0xFFFF
    bits = np.empty(n, np.int16)
    _round_each(values, rands, bits)
    ours = bits.view(np.float16).astype(np.float64)
    assert np.array_equal(ours, _stochastic_f16_reference(values, rands))


@njit
def _draws(ids: np.ndarray, steps: int, sr_key: np.uint64) -> np.ndarray:
    """Column 0's 13-bit draws of rows ``ids`` over ``steps`` Adagrad-like updates with the
    same gradient each time (only the row's state, creeping up, tells them apart)."""
    out = np.empty((steps, ids.shape[0]), np.int64)
    grad = np.float32(0.01)
    for i in range(ids.shape[0]):
        acc = np.float32(1e-3)
        for t in range(steps):
            acc = acc + grad * grad
            key = row_types.row_key(np.int16(0), ids[i], np.float32(acc).view(np.uint32), sr_key)
            out[t, i] = row_types.draw32(key, grad) >> np.uint32(19)
    return out


def test_rounding_draws_are_uniform_and_uncorrelated_on_structured_rows() -> None:
    """Sequential ids, a state that moves by little, one gradient: the draws that decide
    the rounding look like independent uniform ones, across rows and across steps."""
    draws = _draws(np.arange(1, 2001, dtype=np.uint64), 40, np.uint64(0x5DEECE66D1234567))
    counts = np.bincount((draws >> 5).ravel(), minlength=256)
    expected = draws.size / 256
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert 170 < chi2 < 340  # 255 degrees of freedom: each side p < 1e-3
    x = draws / 8192.0 - 0.5
    for a, b in ((x[:-1], x[1:]), (x[:, :-1], x[:, 1:])):  # step to step, row to row
        assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 0.02
    assert abs((draws / 8192.0 + 0.3 >= 1.0).mean() - 0.3) < 0.01


def _tiny_steps(row_dtype: str, stochastic: bool, steps: int = 1000) -> np.ndarray:
    """Rows at 1.0 after ``steps`` SGD steps of +1e-4 each (under half a float16 unit)."""
    table = EmbeddingTable(dim=16, optimizer=SGDConfig(lr=1.0), init_lower=1.0, init_upper=1.0,
                           row_dtype=row_dtype, stochastic_rounding=stochastic, seed=3)
    ids = np.arange(1, 5, dtype=np.uint64)
    grads = np.full((4, 16), -1e-4, np.float32)
    for _ in range(steps):
        table.lookup(ids, True)
        table.update(ids, grads)
    return table.lookup(ids, False)


@pytest.mark.parametrize("row_dtype", ["float16", "bfloat16"])
def test_tiny_updates_add_up_with_stochastic_rounding_and_vanish_without(row_dtype) -> None:
    assert (_tiny_steps(row_dtype, stochastic=False) == 1.0).all()  # every step lost
    moved = _tiny_steps(row_dtype, stochastic=True).astype(np.float64)
    # 1000 steps of 1e-4 make 1.1 on average. Each step rounds up with probability
    # p = 1e-4 / unit, so a value is off by the sum of 1000 such errors: a standard
    # deviation of unit * sqrt(1000 p (1 - p)), and its mean over 64 values 8 times less.
    unit = 2.0**-10 if row_dtype == "float16" else 2.0**-7
    p = 1e-4 / unit
    sigma = unit * np.sqrt(1000 * p * (1 - p))
    assert abs(moved.mean() - 1.1) < 4 * sigma / 8
    assert 0.5 * sigma < moved.std() < 2 * sigma


def _trained(row_dtype: str, optimizer, seed: int = 5, steps: int = 5) -> EmbeddingTable:
    table = EmbeddingTable(dim=8, optimizer=optimizer, row_dtype=row_dtype, seed=seed,
                           num_shards=2, init_lower=-0.5, init_upper=0.5)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        ids = rng.integers(1, 3000, 2000).astype(np.uint64)
        table.lookup(ids, True)
        table.update(ids, rng.standard_normal((ids.size, 8)).astype(np.float32))
    return table


@pytest.mark.parametrize("optimizer", [
    SGDConfig(lr=0.05), AdagradConfig(lr=0.1), AdagradConfig(lr=0.1, vectorwise_shared=True),
    AdamConfig(lr=0.01)], ids=repr)
@pytest.mark.parametrize("row_dtype", ["float16", "bfloat16"])
def test_half_rows_follow_float32_training_and_repeat_bit_for_bit(row_dtype, optimizer) -> None:
    full, half, again, other = (_sorted(_trained(kind, optimizer, seed).export_rows())
                                for kind, seed in (("float32", 5), (row_dtype, 5),
                                                   (row_dtype, 5), (row_dtype, 6)))
    for key in ("ids", "weights", "state"):
        assert np.array_equal(half[key], again[key]), key  # reproducible
    widened = row_types.to_float32(half["weights"], row_dtype)
    unit = 2.0**-10 if row_dtype == "float16" else 2.0**-7
    assert np.abs(widened - full["weights"]).max() < 6 * unit
    assert half["state"].dtype == np.float32  # optimizer state stays float32
    assert not np.array_equal(other["weights"], half["weights"])  # the seed keys rounding


def _sorted(rows: dict) -> dict:
    """Rows by id (internal shards are keyed by a per-process secret: the order varies)."""
    order = np.argsort(rows["ids"])
    return {k: rows[k][order] for k in ("ids", "weights", "state")}


def test_float16_tables_answer_their_rows_as_stored() -> None:
    table = _trained("float16", AdagradConfig(lr=0.1, vectorwise_shared=True))
    ids = np.array([5, 77, 2_000_000, 5], np.uint64)  # one absent, one repeated
    as_stored = table.lookup(ids, False, dtype=np.float16)
    assert as_stored.dtype == np.float16
    assert np.array_equal(as_stored.astype(np.float32), table.lookup(ids, False))
    assert (as_stored[2] == 0).all()
    with pytest.raises(ValueError, match="answers float32 rows"):
        _trained("bfloat16", SGDConfig(lr=0.1), steps=1).lookup(ids, False, dtype=np.float16)


def test_half_tables_refuse_bad_imports_and_take_others_converted() -> None:
    table = EmbeddingTable(dim=2, optimizer=SGDConfig(lr=0.1), row_dtype="bfloat16")
    ids = np.array([1, 2], np.uint64)
    state = np.zeros((2, 0), np.float32)
    with pytest.raises(ValueError, match="weights must be uint16"):
        table.import_rows(ids, np.zeros((2, 2), np.float32), state, row_dtype="bfloat16")
    inf = np.full((2, 2), 0x7F80, np.uint16)
    with pytest.raises(ValueError, match="NaN or infinite"):
        table.import_rows(ids, inf, state, row_dtype="bfloat16")
    with pytest.raises(ValueError, match="row_dtype"):
        table.import_rows(ids, np.zeros((2, 2), np.float32), state, row_dtype="float8")
    with pytest.raises(ValueError, match="ids are not distinct: id 2 repeats"):
        table.import_rows(np.array([2, 2], np.uint64), np.zeros((2, 2), np.float16), state,
                          row_dtype="float16")
    assert table.num_entries == 0
    table.import_rows(ids, np.array([[1.0, 2.0], [3.0, -4.0]], np.float16), state,
                      row_dtype="float16")
    assert np.array_equal(table.lookup(ids, False), [[1.0, 2.0], [3.0, -4.0]])
    with pytest.raises(ValueError, match="row_dtype: expected one of"):
        EmbeddingTable(dim=2, optimizer=SGDConfig(lr=0.1), row_dtype="half")


def test_config_sets_storage_types_per_slot_with_a_default() -> None:
    cfg = embedding_config_from_dict({
        "row_dtype": "float16", "stochastic_rounding": False,
        "slots_config": {"a": {"dim": 4}, "b": {"dim": 4, "row_dtype": "bfloat16"}}})
    assert cfg.row_dtype_of("a") == "float16" and cfg.row_dtype_of("b") == "bfloat16"
    assert not cfg.stochastic_rounding
    with pytest.raises(ConfigError, match=r"slots_config\.a\.row_dtype: expected 'float32'"):
        embedding_config_from_dict({"slots_config": {"a": {"dim": 4, "row_dtype": "fp16"}}})
    with pytest.raises(ConfigError, match="row_dtype must be equal"):
        embedding_config_from_dict({
            "feature_groups": {"g": ["a", "b"]},
            "slots_config": {"a": {"dim": 4}, "b": {"dim": 4, "row_dtype": "float16"}}})


def test_float16_rows_go_on_a_float16_wire_without_a_conversion(monkeypatch) -> None:
    from persia_py.config import GlobalConfig
    from persia_py.proto import parameter_server_pb2 as pb
    from persia_py.servers.parameter_server import ParameterServer
    from persia_py.servers.service import ParameterServerServicer
    from persia_py.wire import codec

    ps = ParameterServer(GlobalConfig(), embedding_config_from_dict(
        {"slots_config": {"a": {"dim": 8, "row_dtype": "float16"}, "b": {"dim": 8}}}))
    ps.configure(optimizer={"type": "sgd", "lr": 0.1})
    servicer = ParameterServerServicer(ps)
    ids = np.arange(1, 1001, dtype=np.uint64)
    casts = []
    original = codec.cast_float
    monkeypatch.setattr(codec, "cast_float", lambda *a, **k: casts.append(a[1]) or original(*a, **k))

    def lookup(table: str, fp16: bool) -> np.ndarray:
        request = pb.LookupRequest(training=True, fp16=fp16, tables=[
            pb.TableIds(table=table, ids=codec.encode(ids))])
        (tensor,) = pb.LookupResponse.FromString(servicer.Lookup(request, None)).embeddings
        return codec.decode(tensor, name="embeddings", ndim=2)

    half = lookup("a", fp16=True)
    assert half.dtype == np.float16 and casts == []  # as stored: no pass over the rows
    (stored,) = ps.lookup([("a", ids)], training=False, answer=LookupAnswer(fp16=True))
    assert np.array_equal(half.view(np.uint16), stored.view(np.uint16))
    assert np.array_equal(lookup("a", fp16=False), half.astype(np.float32))
    # float32 rows are narrowed as they are gathered, as numpy's cast narrows them.
    narrowed = lookup("b", fp16=True)
    assert narrowed.dtype == np.float16 and casts == []
    assert np.array_equal(narrowed.view(np.uint16),
                          lookup("b", fp16=False).astype(np.float16).view(np.uint16))


def test_float32_rows_answered_in_float16_round_as_numpy_casts() -> None:
    """To nearest, ties to even, infinity past float16's range, subnormals kept: the
    float16 answer of a float32 table is numpy's cast of its float32 answer, bit for bit."""
    table = EmbeddingTable(dim=8, optimizer=SGDConfig(lr=0.1))
    step = 2.0 ** -10
    values = np.array([[1 + step / 2, 1 + 3 * step / 2, -(1 + step / 2), 65504, 65519.9,
                        65520, -1e6, 3e-8],
                       np.random.default_rng(0).normal(size=8) * 1e-3], np.float32)
    ids = np.array([5, 9], np.uint64)
    table.import_rows(ids, values, np.zeros((2, 0), np.float32), row_dtype="float32")
    half = table.lookup(np.array([9, 5, 7, 5], np.uint64), False, dtype=np.float16)
    expected = np.concatenate([values[[1, 0]], np.zeros((1, 8), np.float32), values[[0]]])
    with np.errstate(over="ignore"):  # infinity past 65504 is the cast being matched
        cast = expected.astype(np.float16)
    assert np.array_equal(half.view(np.uint16), cast.view(np.uint16))
    assert half[1, 0] == 1.0 and half[1, 1] == 1 + 2 * step and np.isinf(half[1, 5])

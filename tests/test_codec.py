"""The wire codec: round trips, fp16, lz4, and clear errors on malformed tensors."""

from __future__ import annotations

import numpy as np
import pytest

from persia_py import codec
from persia_py.proto import common_pb2


@pytest.mark.parametrize("dtype", ["float32", "float16", "uint64", "int64", "int32", "bool"])
@pytest.mark.parametrize("compress", [False, True])
def test_round_trip(dtype: str, compress: bool) -> None:
    array = (np.arange(60).reshape(3, 4, 5) % 7).astype(dtype)
    decoded = codec.decode(codec.encode(array, compress=compress))
    assert decoded.dtype == array.dtype and decoded.shape == array.shape
    np.testing.assert_array_equal(decoded, array)


def test_empty_and_large_uint64_ids_survive() -> None:
    ids = np.array([0, 2**63, 2**64 - 2], dtype=np.uint64)
    np.testing.assert_array_equal(codec.decode(codec.encode(ids, compress=True)), ids)
    empty = codec.decode(codec.encode(np.zeros((0, 8), np.float32), compress=True))
    assert empty.shape == (0, 8)


def test_fp16_travels_half_and_widens_on_request() -> None:
    array = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
    tensor = codec.encode(array, fp16=True)
    assert tensor.dtype == "float16" and len(tensor.data) == array.size * 2
    decoded = codec.decode(tensor, as_float32=True)
    assert decoded.dtype == np.float32
    np.testing.assert_allclose(decoded, array, atol=1e-3)


def test_lz4_shrinks_repetitive_payloads() -> None:
    array = np.zeros((1000, 32), np.float32)
    assert len(codec.encode(array, compress=True).data) < array.nbytes // 10


@pytest.mark.parametrize(
    "tensor, expectation, message",
    [
        (common_pb2.Tensor(dtype="complex64", shape=[1], data=b"\0" * 8), {}, "unknown dtype"),
        (common_pb2.Tensor(dtype="float32", shape=[2, 2], data=b"\0" * 12), {}, "needs 16 bytes"),
        (common_pb2.Tensor(dtype="float32", shape=[-1], data=b""), {}, "negative"),
        (common_pb2.Tensor(dtype="float32", shape=[1 << 20, 1 << 20], data=b""), {}, "more than"),
        (common_pb2.Tensor(dtype="float32", shape=[2], data=b"garbage", lz4=True), {}, "lz4"),
        # A claimed size no lz4 payload of this length can reach is refused before allocating.
        (common_pb2.Tensor(dtype="float64", shape=[1 << 30], data=b"\x1f\0\x01\0", lz4=True),
         {}, "4 lz4 bytes cannot decompress to the 8589934592 bytes"),
        (common_pb2.Tensor(dtype="int32", shape=[2], data=b"\0" * 8), {"dtypes": ("uint64",)},
         "not accepted"),
        (common_pb2.Tensor(dtype="uint64", shape=[1, 1], data=b"\0" * 8), {"ndim": 1},
         "expected 1 dimensions"),
    ],
)
def test_malformed_tensors_name_the_problem(tensor, expectation, message) -> None:
    with pytest.raises(codec.CodecError, match=message) as info:
        codec.decode(tensor, name="slots[0].ids", **expectation)
    assert "slots[0].ids" in str(info.value)



def test_id_feature_round_trip() -> None:
    ids = np.array([5, 6, 7], np.uint64)
    lengths = np.array([2, 0, 1], np.int32)
    slot, got_ids, got_lengths = codec.decode_id_feature(
        codec.encode_id_feature("s", ids, lengths), "features[0]")
    assert slot == "s"
    np.testing.assert_array_equal(got_ids, ids)
    np.testing.assert_array_equal(got_lengths, lengths)

"""The wire codec: round trips, fp16, lz4, and clear errors on malformed tensors."""

from __future__ import annotations

import numpy as np
import pytest

from persia_py.proto import common_pb2
from persia_py.proto import parameter_server_pb2 as ps_pb
from persia_py.wire import codec


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
        codec.decode(tensor, name="tables[0].ids", **expectation)
    assert "tables[0].ids" in str(info.value)



def test_id_feature_round_trip() -> None:
    ids = np.array([5, 6, 7], np.uint64)
    lengths = np.array([2, 0, 1], np.int32)
    slot, got_ids, got_lengths = codec.decode_id_feature(
        codec.encode_id_feature("s", ids, lengths), "features[0]")
    assert slot == "s"
    np.testing.assert_array_equal(got_ids, ids)
    np.testing.assert_array_equal(got_lengths, lengths)


def _update_pieces(slots, **wire) -> list:
    pieces = [ps_pb.UpdateRequest(worker_id="w", sequence=7).SerializeToString()]
    for slot, ids, grads in slots:
        pieces += codec.message_field(1, [ps_pb.TableGradients(table=slot).SerializeToString(),
                                          *codec.tensor_field(2, ids),
                                          *codec.tensor_field(3, grads, **wire)])
    return pieces


@pytest.mark.parametrize("wire", [{}, {"fp16": True}, {"compress": True}])
def test_pieces_join_into_the_message_protobuf_writes(wire) -> None:
    slots = [("a", np.arange(5, dtype=np.uint64), np.linspace(0, 1, 15, dtype=np.float32).reshape(5, 3)),
             ("b", np.zeros(0, np.uint64), np.zeros((0, 3), np.float32))]
    written = codec.join(_update_pieces(slots, **wire))
    expected = ps_pb.UpdateRequest(worker_id="w", sequence=7, tables=[
        ps_pb.TableGradients(table=s, ids=codec.encode(i), grads=codec.encode(g, **wire))
        for s, i, g in slots])
    assert ps_pb.UpdateRequest.FromString(written) == expected
    if not wire.get("compress"):  # the same bytes, field order aside
        assert sorted(written) == sorted(expected.SerializeToString())


def test_parse_reads_arrays_without_copies_and_scalars_like_protobuf() -> None:
    grads = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    written = codec.join(_update_pieces([("a", np.arange(4, dtype=np.uint64), grads)], fp16=True))
    parsed = codec.parse(ps_pb.UpdateRequest, written)
    assert (parsed.worker_id, parsed.sequence, len(parsed.tables)) == ("w", 7, 1)
    (table,) = parsed.tables
    assert table.table == "a" and table.grads.dtype == "float16" and not table.grads.lz4
    view = codec.decode(table.grads, ndim=2, copy=False)
    assert not view.flags.writeable and view.base is not None  # a view of `written`
    np.testing.assert_allclose(codec.decode(table.grads, as_float32=True), grads, atol=1e-3)
    empty = codec.parse(ps_pb.UpdateRequest, b"")
    assert empty.tables == [] and empty.worker_id == ""


@pytest.mark.parametrize("raw, message", [
    (b"\xff", "bad varint"),
    (b"\x0a\x05ab", "truncated"),
    (b"\x0f", "wire type 7"),
    (b"\x0a\x04\x12\x00\x12\x00", "appears 2 times"),  # a slot with ids twice
])
def test_parse_refuses_malformed_messages(raw, message) -> None:
    with pytest.raises(codec.CodecError, match=message):
        codec.parse(ps_pb.UpdateRequest, raw)


@pytest.mark.parametrize("parsed", [False, True], ids=["protobuf", "raw"])
def test_decoded_size_is_judged_from_claims_before_decompressing(parsed: bool) -> None:
    zeros = np.zeros((1024, 64), np.float32)  # 256 KiB that compress to about 1 KiB
    written = codec.join(_update_pieces([("a", np.arange(1024, dtype=np.uint64), zeros)] * 2,
                                        compress=True))
    message = (codec.parse(ps_pb.UpdateRequest, written) if parsed
               else ps_pb.UpdateRequest.FromString(written))
    codec.check_decoded_size(message, len(written), 2 * zeros.nbytes + 64 * 1024, what="limit")
    with pytest.raises(codec.CodecError, match=r"tables\[1\]\.grads: lz4 payload claims 262144 "
                                               r"decoded bytes.*larger than max.*limit"):
        codec.check_decoded_size(message, len(written), zeros.nbytes + 64 * 1024, what="limit")
    # A claim past what any payload could back, with a nonsense shape, is judged the same.
    bomb = ps_pb.UpdateRequest(tables=[ps_pb.TableGradients(grads=common_pb2.Tensor(
        dtype="float32", shape=[2**40, 2**40], data=b"x", lz4=True))])
    with pytest.raises(codec.CodecError, match=r"tables\[0\]\.grads"):
        codec.check_decoded_size(bomb, bomb.ByteSize(), 2**31, what="limit")


def test_parse_builds_a_bounded_number_of_sub_messages() -> None:
    within = b"\x0a\x00" * codec.MAX_PARSED_MESSAGES  # empty entries: no tensors built
    assert len(codec.parse(ps_pb.UpdateRequest, within).tables) == codec.MAX_PARSED_MESSAGES
    with pytest.raises(codec.CodecError, match="sub-messages"):
        codec.parse(ps_pb.UpdateRequest, b"\x0a\x00" * (codec.MAX_PARSED_MESSAGES + 1))

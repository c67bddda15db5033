"""The wire codec: numpy arrays <-> ``Tensor`` messages (bytes + dtype + shape).

Every array that crosses the wire goes through :func:`encode` (or, for big messages,
:func:`tensor_field` pieces joined by :func:`join`, which lay out the same bytes without
protobuf's copies) and :func:`decode` (of a message
protobuf parsed, or of one :func:`parse` read without copying its arrays' bytes).
Decoding validates everything a peer could get wrong (dtype, shape, byte length,
compression) and raises :class:`CodecError` with a message that names the field; sizes a
peer claims are checked before anything is allocated for them (:func:`check_decoded_size`
for a whole message's lz4 payloads, :data:`MAX_PARSED_MESSAGES` for what :func:`parse`
builds).
"""

from __future__ import annotations

import ctypes
import io
import math
import warnings
from collections.abc import Iterator
from functools import cache
from typing import Any

import lz4.block
import numpy as np
from google.protobuf import message_factory
from google.protobuf.message import Message

from persia_py.proto import common_pb2

WIRE_DTYPES = frozenset(
    ["float16", "float32", "float64", "uint64", "int64", "int32", "int16", "int8", "uint8", "bool"]
)
"""Dtypes allowed on the wire."""

MAX_ELEMENTS = 1 << 31
"""Upper bound on the elements of one decoded array (a guard against absurd shapes)."""


MAX_PARSED_MESSAGES = 1 << 14
"""Most sub-messages :func:`parse` builds for one message. Each costs a few hundred bytes
of memory for the two bytes it may take on the wire, so without a bound a small request
of empty entries would cost gigabytes. A slot takes up to three (its entry, ids and
gradients or lengths), so this allows over 5,000 slots per request."""

_LZ4_MAX_RATIO = 255


def cast_float(array: np.ndarray, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """``array`` as float16/float32 (into ``out`` if given), bit-identical to numpy's cast.

    The cast runs through torch's vectorized kernels: numpy's float16 conversion is slow
    for values that are tiny in float16, as gradients often are, and torch's is not
    (figures in docs/benchmarks.md).
    """
    import torch  # a dependency of the package; imported here so codec users need not load it

    array = np.ascontiguousarray(array)
    if array.flags.writeable:
        source = torch.from_numpy(array)
    else:  # a view of a received message: only read here, so torch's warning does not apply
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            source = torch.from_numpy(array)
    if out is not None:
        torch.from_numpy(out).copy_(source)
        return out
    return source.to(getattr(torch, np.dtype(dtype).name)).numpy()


class CodecError(ValueError):
    """A Tensor message that cannot be decoded; the message says which field and why."""


def _wire_array(array: np.ndarray, fp16: bool) -> np.ndarray:
    """``array`` as it travels: C-contiguous little-endian, floats narrowed if ``fp16``."""
    array = np.asarray(array)
    if fp16 and array.dtype.kind == "f" and array.dtype != np.float16:
        array = cast_float(array, "float16")
    if array.dtype.name not in WIRE_DTYPES:
        raise CodecError(f"dtype {array.dtype.name} cannot travel; allowed: {sorted(WIRE_DTYPES)}")
    return np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False)


def encode(array: np.ndarray, *, fp16: bool = False, compress: bool = False) -> common_pb2.Tensor:
    """Encode ``array`` as a Tensor; ``fp16`` sends float arrays as float16."""
    array = _wire_array(array, fp16)
    data = array.tobytes()
    if compress and data:
        data = lz4.block.compress(data, store_size=False)
    else:
        compress = False
    return common_pb2.Tensor(dtype=array.dtype.name, shape=array.shape, data=data, lz4=compress)


def decode(
    tensor: common_pb2.Tensor,
    *,
    name: str = "tensor",
    dtypes: tuple[str, ...] | None = None,
    ndim: int | None = None,
    as_float32: bool = False,
    copy: bool = True,
    data: Any = None,
) -> np.ndarray:
    """Decode a Tensor (or a :class:`RawMessage` of one), checking it against what the
    caller expects.

    ``name`` is used in error messages; ``dtypes`` and ``ndim`` restrict what is
    accepted; ``as_float32`` widens float16 payloads to float32. ``copy=False`` may
    return a read-only view of the message's bytes (for arrays only read, then sent on).
    ``data``: the array's bytes when they did not travel in the message (a bounds-checked
    piece of a shared-memory segment, :mod:`persia_py.wire.shm`); checked the same way.
    """
    if tensor.dtype not in WIRE_DTYPES:
        raise CodecError(f"{name}: unknown dtype {tensor.dtype!r}; allowed: {sorted(WIRE_DTYPES)}")
    if dtypes is not None and tensor.dtype not in dtypes:
        raise CodecError(f"{name}: dtype {tensor.dtype} not accepted here; expected one of {dtypes}")
    shape = tuple(tensor.shape)
    if ndim is not None and len(shape) != ndim:
        raise CodecError(f"{name}: expected {ndim} dimensions, got shape {shape}")
    if any(s < 0 for s in shape):
        raise CodecError(f"{name}: negative dimension in shape {shape}")
    num_elements = int(math.prod(shape, start=1.0))  # float: an absurd shape overflows to inf
    if num_elements > MAX_ELEMENTS:
        raise CodecError(f"{name}: shape {shape} has more than {MAX_ELEMENTS} elements")
    dtype = np.dtype(tensor.dtype).newbyteorder("<")
    expected_bytes = num_elements * dtype.itemsize
    if data is None:
        data = tensor.data
    elif tensor.lz4 or len(tensor.data):
        raise CodecError(f"{name}: an array outside the message has no data or lz4 in it")
    if tensor.lz4:
        # LZ4 cannot expand data more than ~255x; a claim beyond that is a lie, and
        # believing it would allocate the claimed size before decompression fails.
        if expected_bytes > _LZ4_MAX_RATIO * len(data) + 64:
            raise CodecError(f"{name}: {len(data)} lz4 bytes cannot decompress to the "
                             f"{expected_bytes} bytes shape {shape} of {tensor.dtype} needs")
        # Fresh memory of its own: no copy needed (none on a little-endian machine).
        array = _decompress(data, np.empty(shape, dtype), name)
        if as_float32 and dtype.name == "float16":
            return cast_float(array, "float32")
        return array.astype(dtype.newbyteorder("="), copy=False)
    if len(data) != expected_bytes:
        raise CodecError(
            f"{name}: shape {shape} of {tensor.dtype} needs {expected_bytes} bytes, got {len(data)}"
        )
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    if as_float32 and dtype.name == "float16":
        return cast_float(array, "float32")  # a new array already
    return array.astype(dtype.newbyteorder("="), copy=copy)


@cache
def _lz4_decompress_into() -> Any:
    """liblz4's ``LZ4_decompress_safe`` (as the lz4 package links it), or None if that
    build does not export it."""
    try:
        function = ctypes.CDLL(lz4.block._block.__file__).LZ4_decompress_safe
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def _decompress(data: Any, out: np.ndarray, name: str) -> np.ndarray:
    """Decompress the lz4 block ``data`` into ``out``, which it must fill exactly.

    ``lz4.block.decompress`` decompresses into a buffer of its own and copies that into
    the ``bytes`` it returns, so a payload would take twice its decoded size at once (and
    a third time as an array); liblz4 writes straight into ``out``, and never past it.
    """
    function = _lz4_decompress_into()
    source = np.frombuffer(data, np.uint8)
    if function is None or source.size >= 2**31 or out.nbytes >= 2**31:
        try:
            decoded = lz4.block.decompress(data, uncompressed_size=out.nbytes)
        except lz4.block.LZ4BlockError as exc:
            raise CodecError(f"{name}: lz4 payload does not decompress: {exc}") from None
        size = len(decoded)
        if size == out.nbytes:
            out.reshape(-1).view(np.uint8)[:] = np.frombuffer(decoded, np.uint8)
    else:
        size = function(source.ctypes.data, out.ctypes.data, source.size, out.nbytes)
        if size < 0:
            raise CodecError(f"{name}: lz4 payload does not decompress (corrupt, or larger "
                             f"than the {out.nbytes} bytes its shape and dtype need)")
    if size != out.nbytes:
        raise CodecError(f"{name}: lz4 payload decompresses to {size} bytes, its shape "
                         f"{out.shape} of {out.dtype.name} needs {out.nbytes}")
    return out


def check_decoded_size(message: Any, wire_bytes: int, limit: int, *, what: str) -> None:
    """Refuse ``message`` (protobuf or :class:`RawMessage`, ``wire_bytes`` long) if its lz4
    payloads would decompress it past ``limit`` bytes, judged from the shapes and dtypes
    its tensors claim, before anything is decompressed.

    LZ4 expands up to 255x, so without this check a request under the message limit could
    make the receiver allocate 255 times that limit. ``what`` names the limit in the error.
    """
    total = wire_bytes
    for name, tensor in _lz4_tensors(message, ""):
        total += claimed_bytes(tensor) - len(tensor.data)
        if total > limit:
            raise CodecError(f"{name}: lz4 payload claims {claimed_bytes(tensor)} decoded bytes, "
                             f"which makes the message larger than max ({total} vs. {limit}, "
                             f"{what})")


def claimed_bytes(tensor: Any) -> int:
    """Bytes ``tensor`` would decode to by its shape and dtype (0 for what decode refuses)."""
    if tensor.dtype not in WIRE_DTYPES:
        return 0
    return min(claimed_elements(tensor) * np.dtype(tensor.dtype).itemsize, 2**62)


def claimed_elements(tensor: Any) -> int:
    """Elements ``tensor`` claims by its shape (0 for a negative dimension, which
    :func:`decode` refuses), before anything is decoded."""
    if any(s < 0 for s in tensor.shape):
        return 0
    # float64: an absurd shape gives inf instead of a huge exact product (math.prod, not
    # numpy's: ~10 us a call, per array of every message, under the GIL)
    return int(min(math.prod(tensor.shape, start=1.0), 2**62))


def _lz4_tensors(message: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """``(field path, tensor)`` of every lz4-compressed Tensor inside ``message``."""
    for f in _fields_with_tensors(message.DESCRIPTOR):
        value = getattr(message, f.name)
        entries = enumerate(value) if f.is_repeated else [(None, value)]
        for i, sub in entries:
            name = f"{prefix}{f.name}" + ("" if i is None else f"[{i}]")
            if f.message_type is common_pb2.Tensor.DESCRIPTOR:
                if sub.lz4:
                    yield name, sub
            else:
                yield from _lz4_tensors(sub, name + ".")


@cache
def _fields_with_tensors(descriptor: Any) -> tuple[Any, ...]:
    """The message-typed fields of ``descriptor`` that are or hold Tensors."""
    return tuple(f for f in descriptor.fields if f.message_type is not None and (
        f.message_type is common_pb2.Tensor.DESCRIPTOR or _fields_with_tensors(f.message_type)))


def encode_id_feature(slot: str, ids: np.ndarray, lengths: np.ndarray) -> common_pb2.IdFeature:
    """One ID-type feature in CSR form: flat uint64 ids and int32 per-sample lengths."""
    return common_pb2.IdFeature(
        slot=slot, ids=encode(ids.astype(np.uint64, copy=False)),
        lengths=encode(lengths.astype(np.int32, copy=False)),
    )


def id_feature_field(field_number: int, slot: str, ids: np.ndarray, lengths: np.ndarray) -> list:
    """Field ``field_number`` holding :func:`encode_id_feature`, as :func:`join` pieces."""
    return message_field(field_number, [
        common_pb2.IdFeature(slot=slot).SerializeToString(),
        *tensor_field(2, ids.astype(np.uint64, copy=False)),
        *tensor_field(3, lengths.astype(np.int32, copy=False)),
    ])


def decode_id_feature(feature: common_pb2.IdFeature, name: str) -> tuple[str, np.ndarray, np.ndarray]:
    """``(slot, ids, lengths)`` of an IdFeature, shapes and dtypes checked."""
    ids = decode(feature.ids, name=f"{name}.ids", dtypes=("uint64",), ndim=1)
    lengths = decode(feature.lengths, name=f"{name}.lengths", dtypes=("int32",), ndim=1)
    return feature.slot, ids, lengths


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(field_number: int) -> bytes:
    """The key of a length-delimited field (wire type 2)."""
    return _varint(field_number << 3 | 2)


def _tensor_header(dtype_name: str, shape: tuple[int, ...], num_bytes: int,
                   compressed: bool = False) -> bytes:
    """A serialized Tensor up to its data, which follow (``num_bytes`` of them)."""
    name = dtype_name.encode()
    header = b"\x0a" + _varint(len(name)) + name  # field 1: dtype
    if shape:
        packed = b"".join(_varint(int(s)) for s in shape)
        header += b"\x12" + _varint(len(packed)) + packed  # field 2: shape, packed
    if compressed:
        header += b"\x20\x01"  # field 4: lz4
    if num_bytes:
        header += b"\x1a" + _varint(num_bytes)  # field 3: data (bytes follow)
    return header


def tensor_field(field_number: int, array: np.ndarray, *, fp16: bool = False,
                 compress: bool = False) -> list:
    """Field ``field_number`` holding :func:`encode` of ``array``, serialized as pieces
    for :func:`message_field` / :func:`join`; the array's bytes are not copied."""
    array = _wire_array(array, fp16)
    data = array.reshape(-1).data.cast("B") if array.size else b""
    if compress and data:
        data = lz4.block.compress(data, store_size=False)
    else:
        compress = False
    header = _tensor_header(array.dtype.name, array.shape, len(data), compress)
    return [_key(field_number) + _varint(len(header) + len(data)) + header, data]


def tensor_field_size(field_number: int, dtype_name: str, shape: tuple[int, ...],
                      num_data_bytes: int, compressed: bool = False) -> int:
    """Serialized size of a :func:`tensor_field` whose data take ``num_data_bytes``."""
    size = len(_tensor_header(dtype_name, shape, num_data_bytes, compressed)) + num_data_bytes
    return len(_key(field_number)) + len(_varint(size)) + size


def lz4_bound(num_bytes: int) -> int:
    """Most bytes lz4 compresses ``num_bytes`` to (``LZ4_compressBound``)."""
    return num_bytes + num_bytes // 255 + 16


class TensorFields:
    """A message of one repeated Tensor field, written in place into the ``bytes`` that
    are sent: :attr:`arrays` are writable views of where each array's data go, and
    :meth:`finish` returns the message without copying it.

    :func:`join` of :func:`tensor_field` pieces would hold the arrays and their copy at
    once (twice the message). A ``BytesIO`` keeps its contents in a ``bytes`` object that
    ``getvalue`` hands out uncopied once no view of it is left, so the arrays are
    dropped (and their views released) before it is called.
    """

    def __init__(self, field_number: int, specs: list[tuple[str, tuple[int, ...]]]) -> None:
        """``specs``: each array's wire dtype name and shape, in field order."""
        layout, offset = [], 0
        for dtype_name, shape in specs:
            num_bytes = math.prod(shape) * np.dtype(dtype_name).itemsize
            header = _tensor_header(dtype_name, shape, num_bytes)
            prefix = _key(field_number) + _varint(len(header) + num_bytes) + header
            layout.append((prefix, offset, dtype_name, shape))
            offset += len(prefix) + num_bytes
        self.size = offset
        """Bytes of the message."""
        self._buffer = io.BytesIO()
        if offset:
            self._buffer.seek(offset - 1)
            self._buffer.write(b"\0")  # the whole message, allocated once
        self._view = self._buffer.getbuffer()
        self.arrays: list[np.ndarray] = []
        for prefix, start, dtype_name, shape in layout:
            self._view[start:start + len(prefix)] = prefix
            self.arrays.append(np.frombuffer(self._view, np.dtype(dtype_name).newbyteorder("<"),
                                             count=math.prod(shape),
                                             offset=start + len(prefix)).reshape(shape))

    def finish(self) -> bytes:
        """The serialized message (a copy only if a view of :attr:`arrays` is still held)."""
        self.arrays = []
        try:
            self._view.release()
        except BufferError:  # someone still holds an array: getvalue copies
            pass
        return self._buffer.getvalue()


def message_field(field_number: int, pieces: list) -> list:
    """Field ``field_number`` holding the message serialized as ``pieces``; a message's
    serialized fields may come in any order, so small fields can be serialized by
    protobuf (``SerializeToString``) and joined with big ones (:func:`tensor_field`)."""
    return [_key(field_number) + _varint(sum(len(p) for p in pieces)), *pieces]


def join(pieces: list) -> bytes:
    """The serialized message: the pieces copied once into one ``bytes``.

    Protobuf would copy an array's bytes three times (``tobytes``, into the message, and
    serializing it); this copies them once.
    """
    return b"".join(pieces)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise CodecError("malformed message: bad varint")
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7


_FIXED_SIZES = {1: 8, 5: 4}


class RawMessage:
    """A message parsed by :func:`parse`: its sub-messages are RawMessages, its ``bytes``
    fields memoryviews of the serialized message, the rest what protobuf parsed."""

    def __init__(self, scalars: Any, fields: dict[str, Any]) -> None:
        self._scalars = scalars
        self._fields = fields

    def __getattr__(self, name: str) -> Any:
        fields = self.__dict__.get("_fields", {})
        if name in fields:
            return fields[name]
        return getattr(self.__dict__["_scalars"], name)


def parse(message_class: type[Message], data: bytes | memoryview) -> RawMessage:
    """``message_class.FromString(data)`` without copying ``bytes`` fields (array data):
    they come back as memoryviews of ``data``, which they keep alive. At most
    :data:`MAX_PARSED_MESSAGES` sub-messages are built."""
    return _parse(message_class.DESCRIPTOR, memoryview(data).cast("B"), [MAX_PARSED_MESSAGES])


@cache
def _empty(descriptor: Any) -> RawMessage:
    """The RawMessage of an absent sub-message (shared: RawMessages are read-only)."""
    return _parse(descriptor, memoryview(b""), [1])


def _parse(descriptor: Any, buf: memoryview, budget: list[int]) -> RawMessage:
    """``budget[0]``: sub-messages that may still be built, shared by the whole parse."""
    special = {f.number: f for f in descriptor.fields
               if f.message_type is not None or f.type == f.TYPE_BYTES}
    values: dict[str, list] = {f.name: [] for f in special.values()}
    scalars, pos = [], 0
    while pos < len(buf):
        start = pos
        key, pos = _read_varint(buf, pos)
        wire_type, field = key & 7, special.get(key >> 3)
        if wire_type == 0:
            _, pos = _read_varint(buf, pos)
        elif wire_type in _FIXED_SIZES:
            pos += _FIXED_SIZES[wire_type]
        elif wire_type == 2:
            size, pos = _read_varint(buf, pos)
            if field is not None and pos + size <= len(buf):
                piece = buf[pos:pos + size]
                value: memoryview | RawMessage = piece
                if field.message_type is not None:
                    budget[0] -= 1
                    if budget[0] < 0:
                        raise CodecError(f"malformed message: more than {MAX_PARSED_MESSAGES} "
                                         f"sub-messages (field {field.name})")
                    value = _parse(field.message_type, piece, budget)
                values[field.name].append(value)
                pos += size
                continue
            pos += size
        else:
            raise CodecError(f"malformed message: wire type {wire_type}")
        if pos > len(buf):
            raise CodecError("malformed message: truncated")
        scalars.append(buf[start:pos])  # protobuf parses (and checks) the other fields
    fields: dict[str, Any] = {}
    for f in special.values():
        found = values[f.name]
        if f.is_repeated:
            fields[f.name] = found
        elif len(found) > 1:
            raise CodecError(f"malformed message: field {f.name} appears {len(found)} times")
        elif found:
            fields[f.name] = found[0]
        else:
            fields[f.name] = b"" if f.message_type is None else _empty(f.message_type)
    return RawMessage(message_factory.GetMessageClass(descriptor).FromString(join(scalars)),
                      fields)



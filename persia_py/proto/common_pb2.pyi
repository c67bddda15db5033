from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "lz4")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LZ4_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    lz4: bool
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., lz4: _Optional[bool] = ...) -> None: ...

class NamedTensor(_message.Message):
    __slots__ = ("name", "tensor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: Tensor
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class IdFeature(_message.Message):
    __slots__ = ("slot", "ids", "lengths")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    slot: str
    ids: Tensor
    lengths: Tensor
    def __init__(self, slot: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., lengths: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ConfigureRequest(_message.Message):
    __slots__ = ("optimizer_json", "init_lower", "init_upper", "weight_bound", "seed")
    OPTIMIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    INIT_LOWER_FIELD_NUMBER: _ClassVar[int]
    INIT_UPPER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BOUND_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    optimizer_json: str
    init_lower: float
    init_upper: float
    weight_bound: float
    seed: int
    def __init__(self, optimizer_json: _Optional[str] = ..., init_lower: _Optional[float] = ..., init_upper: _Optional[float] = ..., weight_bound: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class ConfigureResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("role", "configured", "instance")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    role: str
    configured: bool
    instance: str
    def __init__(self, role: _Optional[str] = ..., configured: _Optional[bool] = ..., instance: _Optional[str] = ...) -> None: ...

class RestartRequest(_message.Message):
    __slots__ = ("reason", "positions")
    REASON_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    reason: str
    positions: str
    def __init__(self, reason: _Optional[str] = ..., positions: _Optional[str] = ...) -> None: ...

class RestartResponse(_message.Message):
    __slots__ = ("instance",)
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    instance: str
    def __init__(self, instance: _Optional[str] = ...) -> None: ...

class ShmSegment(_message.Message):
    __slots__ = ("name", "nonce", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    nonce: str
    size: int
    def __init__(self, name: _Optional[str] = ..., nonce: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class ShmUse(_message.Message):
    __slots__ = ("used", "refused", "needed_bytes")
    USED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    NEEDED_BYTES_FIELD_NUMBER: _ClassVar[int]
    used: bool
    refused: str
    needed_bytes: int
    def __init__(self, used: _Optional[bool] = ..., refused: _Optional[str] = ..., needed_bytes: _Optional[int] = ...) -> None: ...

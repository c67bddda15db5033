from persia_py.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutBatchRequest(_message.Message):
    __slots__ = ("features", "batch_size", "requires_grad", "stream", "batch_id")
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_GRAD_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    features: _containers.RepeatedCompositeFieldContainer[_common_pb2.IdFeature]
    batch_size: int
    requires_grad: bool
    stream: str
    batch_id: int
    def __init__(self, features: _Optional[_Iterable[_Union[_common_pb2.IdFeature, _Mapping]]] = ..., batch_size: _Optional[int] = ..., requires_grad: _Optional[bool] = ..., stream: _Optional[str] = ..., batch_id: _Optional[int] = ...) -> None: ...

class PutBatchResponse(_message.Message):
    __slots__ = ("ref",)
    REF_FIELD_NUMBER: _ClassVar[int]
    ref: int
    def __init__(self, ref: _Optional[int] = ...) -> None: ...

class WireOptions(_message.Message):
    __slots__ = ("fp16", "lz4")
    FP16_FIELD_NUMBER: _ClassVar[int]
    LZ4_FIELD_NUMBER: _ClassVar[int]
    fp16: bool
    lz4: bool
    def __init__(self, fp16: _Optional[bool] = ..., lz4: _Optional[bool] = ...) -> None: ...

class LookupBatchRequest(_message.Message):
    __slots__ = ("ref", "wire", "answer_segment", "forget_segments")
    REF_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    ANSWER_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    FORGET_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    ref: int
    wire: WireOptions
    answer_segment: _common_pb2.ShmSegment
    forget_segments: _containers.RepeatedCompositeFieldContainer[_common_pb2.ShmSegment]
    def __init__(self, ref: _Optional[int] = ..., wire: _Optional[_Union[WireOptions, _Mapping]] = ..., answer_segment: _Optional[_Union[_common_pb2.ShmSegment, _Mapping]] = ..., forget_segments: _Optional[_Iterable[_Union[_common_pb2.ShmSegment, _Mapping]]] = ...) -> None: ...

class LookupDirectRequest(_message.Message):
    __slots__ = ("features", "batch_size", "wire")
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    features: _containers.RepeatedCompositeFieldContainer[_common_pb2.IdFeature]
    batch_size: int
    wire: WireOptions
    def __init__(self, features: _Optional[_Iterable[_Union[_common_pb2.IdFeature, _Mapping]]] = ..., batch_size: _Optional[int] = ..., wire: _Optional[_Union[WireOptions, _Mapping]] = ...) -> None: ...

class SlotEmbedding(_message.Message):
    __slots__ = ("slot", "rows", "index", "lengths", "pooling", "sqrt_scaling", "sample_fixed_size", "hash_stack_rounds", "shm_offsets")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    SQRT_SCALING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIXED_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_STACK_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    slot: str
    rows: _common_pb2.Tensor
    index: _common_pb2.Tensor
    lengths: _common_pb2.Tensor
    pooling: str
    sqrt_scaling: bool
    sample_fixed_size: int
    hash_stack_rounds: int
    shm_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slot: _Optional[str] = ..., rows: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., index: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., lengths: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., pooling: _Optional[str] = ..., sqrt_scaling: _Optional[bool] = ..., sample_fixed_size: _Optional[int] = ..., hash_stack_rounds: _Optional[int] = ..., shm_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupBatchResponse(_message.Message):
    __slots__ = ("slots", "shm")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedCompositeFieldContainer[SlotEmbedding]
    shm: _common_pb2.ShmUse
    def __init__(self, slots: _Optional[_Iterable[_Union[SlotEmbedding, _Mapping]]] = ..., shm: _Optional[_Union[_common_pb2.ShmUse, _Mapping]] = ...) -> None: ...

class SlotRowGradients(_message.Message):
    __slots__ = ("slot", "grads", "shm_offset")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    slot: str
    grads: _common_pb2.Tensor
    shm_offset: int
    def __init__(self, slot: _Optional[str] = ..., grads: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., shm_offset: _Optional[int] = ...) -> None: ...

class UpdateGradientsRequest(_message.Message):
    __slots__ = ("ref", "slots", "rerouted", "grads_segment", "forget_segments")
    REF_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    REROUTED_FIELD_NUMBER: _ClassVar[int]
    GRADS_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    FORGET_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    ref: int
    slots: _containers.RepeatedCompositeFieldContainer[SlotRowGradients]
    rerouted: bool
    grads_segment: _common_pb2.ShmSegment
    forget_segments: _containers.RepeatedCompositeFieldContainer[_common_pb2.ShmSegment]
    def __init__(self, ref: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[SlotRowGradients, _Mapping]]] = ..., rerouted: _Optional[bool] = ..., grads_segment: _Optional[_Union[_common_pb2.ShmSegment, _Mapping]] = ..., forget_segments: _Optional[_Iterable[_Union[_common_pb2.ShmSegment, _Mapping]]] = ...) -> None: ...

class UpdateGradientsResponse(_message.Message):
    __slots__ = ("num_updated", "shm")
    NUM_UPDATED_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    num_updated: int
    shm: _common_pb2.ShmUse
    def __init__(self, num_updated: _Optional[int] = ..., shm: _Optional[_Union[_common_pb2.ShmUse, _Mapping]] = ...) -> None: ...

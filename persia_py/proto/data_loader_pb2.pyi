from persia_py.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NextBatchRequest(_message.Message):
    __slots__ = ("rank", "consumer", "request_seq", "done", "only_done")
    RANK_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_SEQ_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ONLY_DONE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    consumer: bytes
    request_seq: int
    done: _containers.RepeatedScalarFieldContainer[int]
    only_done: bool
    def __init__(self, rank: _Optional[int] = ..., consumer: _Optional[bytes] = ..., request_seq: _Optional[int] = ..., done: _Optional[_Iterable[int]] = ..., only_done: _Optional[bool] = ...) -> None: ...

class ResendBatchRequest(_message.Message):
    __slots__ = ("batch_id",)
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    def __init__(self, batch_id: _Optional[int] = ...) -> None: ...

class ResendBatchResponse(_message.Message):
    __slots__ = ("embedding_worker", "ref")
    EMBEDDING_WORKER_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    embedding_worker: int
    ref: int
    def __init__(self, embedding_worker: _Optional[int] = ..., ref: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("batch_id", "batch_size", "embedding_worker", "ref", "non_id_features", "labels", "meta", "requires_grad")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_WORKER_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    NON_ID_FEATURES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_GRAD_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    batch_size: int
    embedding_worker: int
    ref: int
    non_id_features: _containers.RepeatedCompositeFieldContainer[_common_pb2.NamedTensor]
    labels: _containers.RepeatedCompositeFieldContainer[_common_pb2.NamedTensor]
    meta: bytes
    requires_grad: bool
    def __init__(self, batch_id: _Optional[int] = ..., batch_size: _Optional[int] = ..., embedding_worker: _Optional[int] = ..., ref: _Optional[int] = ..., non_id_features: _Optional[_Iterable[_Union[_common_pb2.NamedTensor, _Mapping]]] = ..., labels: _Optional[_Iterable[_Union[_common_pb2.NamedTensor, _Mapping]]] = ..., meta: _Optional[bytes] = ..., requires_grad: _Optional[bool] = ...) -> None: ...

class NextBatchResponse(_message.Message):
    __slots__ = ("batch", "has_batch", "end_of_stream")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    HAS_BATCH_FIELD_NUMBER: _ClassVar[int]
    END_OF_STREAM_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    has_batch: bool
    end_of_stream: bool
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., has_batch: _Optional[bool] = ..., end_of_stream: _Optional[bool] = ...) -> None: ...

from persia_py.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PredictRequest(_message.Message):
    __slots__ = ("id_features", "non_id_features")
    ID_FEATURES_FIELD_NUMBER: _ClassVar[int]
    NON_ID_FEATURES_FIELD_NUMBER: _ClassVar[int]
    id_features: _containers.RepeatedCompositeFieldContainer[_common_pb2.IdFeature]
    non_id_features: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tensor]
    def __init__(self, id_features: _Optional[_Iterable[_Union[_common_pb2.IdFeature, _Mapping]]] = ..., non_id_features: _Optional[_Iterable[_Union[_common_pb2.Tensor, _Mapping]]] = ...) -> None: ...

class PredictResponse(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tensor]
    def __init__(self, outputs: _Optional[_Iterable[_Union[_common_pb2.Tensor, _Mapping]]] = ...) -> None: ...

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class DumpRequest(_message.Message):
    __slots__ = ("folder", "checkpoint")
    FOLDER_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    folder: str
    checkpoint: str
    def __init__(self, folder: _Optional[str] = ..., checkpoint: _Optional[str] = ...) -> None: ...

class DumpResponse(_message.Message):
    __slots__ = ("num_rows", "num_bytes", "replica_index", "replica_size")
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_rows: int
    num_bytes: int
    replica_index: int
    replica_size: int
    def __init__(self, num_rows: _Optional[int] = ..., num_bytes: _Optional[int] = ..., replica_index: _Optional[int] = ..., replica_size: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("folder", "checkpoint")
    FOLDER_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    folder: str
    checkpoint: str
    def __init__(self, folder: _Optional[str] = ..., checkpoint: _Optional[str] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("num_rows", "num_bytes")
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_rows: int
    num_bytes: int
    def __init__(self, num_rows: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

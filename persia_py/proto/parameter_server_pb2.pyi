from persia_py.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TableIds(_message.Message):
    __slots__ = ("table", "ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: _common_pb2.Tensor
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("tables", "training", "fp16", "lz4", "answer_segment", "forget_segments")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    FP16_FIELD_NUMBER: _ClassVar[int]
    LZ4_FIELD_NUMBER: _ClassVar[int]
    ANSWER_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    FORGET_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableIds]
    training: bool
    fp16: bool
    lz4: bool
    answer_segment: _common_pb2.ShmSegment
    forget_segments: _containers.RepeatedCompositeFieldContainer[_common_pb2.ShmSegment]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableIds, _Mapping]]] = ..., training: _Optional[bool] = ..., fp16: _Optional[bool] = ..., lz4: _Optional[bool] = ..., answer_segment: _Optional[_Union[_common_pb2.ShmSegment, _Mapping]] = ..., forget_segments: _Optional[_Iterable[_Union[_common_pb2.ShmSegment, _Mapping]]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("embeddings", "shm", "shm_offsets")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tensor]
    shm: _common_pb2.ShmUse
    shm_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, embeddings: _Optional[_Iterable[_Union[_common_pb2.Tensor, _Mapping]]] = ..., shm: _Optional[_Union[_common_pb2.ShmUse, _Mapping]] = ..., shm_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableIds]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableIds, _Mapping]]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("queued",)
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    queued: bool
    def __init__(self, queued: _Optional[bool] = ...) -> None: ...

class TableGradients(_message.Message):
    __slots__ = ("table", "ids", "grads", "grads_offset")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    GRADS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: _common_pb2.Tensor
    grads: _common_pb2.Tensor
    grads_offset: int
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., grads: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., grads_offset: _Optional[int] = ...) -> None: ...

class UpdateRequest(_message.Message):
    __slots__ = ("tables", "worker_id", "sequence", "grads_segment", "forget_segments")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    GRADS_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    FORGET_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableGradients]
    worker_id: str
    sequence: int
    grads_segment: _common_pb2.ShmSegment
    forget_segments: _containers.RepeatedCompositeFieldContainer[_common_pb2.ShmSegment]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableGradients, _Mapping]]] = ..., worker_id: _Optional[str] = ..., sequence: _Optional[int] = ..., grads_segment: _Optional[_Union[_common_pb2.ShmSegment, _Mapping]] = ..., forget_segments: _Optional[_Iterable[_Union[_common_pb2.ShmSegment, _Mapping]]] = ...) -> None: ...

class UpdateResponse(_message.Message):
    __slots__ = ("num_updated", "duplicate", "shm")
    NUM_UPDATED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    num_updated: int
    duplicate: bool
    shm: _common_pb2.ShmUse
    def __init__(self, num_updated: _Optional[int] = ..., duplicate: _Optional[bool] = ..., shm: _Optional[_Union[_common_pb2.ShmUse, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TableStats(_message.Message):
    __slots__ = ("table", "entries", "bytes", "hits", "misses", "inserted", "evicted", "admitted", "rejected", "expired", "disk")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    INSERTED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    table: str
    entries: int
    bytes: int
    hits: int
    misses: int
    inserted: int
    evicted: int
    admitted: int
    rejected: int
    expired: int
    disk: DiskTierStats
    def __init__(self, table: _Optional[str] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., inserted: _Optional[int] = ..., evicted: _Optional[int] = ..., admitted: _Optional[int] = ..., rejected: _Optional[int] = ..., expired: _Optional[int] = ..., disk: _Optional[_Union[DiskTierStats, _Mapping]] = ...) -> None: ...

class DiskTierStats(_message.Message):
    __slots__ = ("disk_rows", "disk_capacity_rows", "disk_slots", "disk_bytes", "disk_ram_bytes", "disk_record_bytes", "disk_block_bytes", "disk_block_reads", "disk_bytes_read", "disk_read", "disk_read_random", "disk_written", "disk_hits", "disk_misses", "disk_evicted", "disk_deleted", "disk_expired", "disk_relocated", "disk_fingerprint_clashes", "disk_answered", "spilled", "restored")
    DISK_ROWS_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_ROWS_FIELD_NUMBER: _ClassVar[int]
    DISK_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_RAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_RECORD_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCK_READS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_RANDOM_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    DISK_HITS_FIELD_NUMBER: _ClassVar[int]
    DISK_MISSES_FIELD_NUMBER: _ClassVar[int]
    DISK_EVICTED_FIELD_NUMBER: _ClassVar[int]
    DISK_DELETED_FIELD_NUMBER: _ClassVar[int]
    DISK_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    DISK_RELOCATED_FIELD_NUMBER: _ClassVar[int]
    DISK_FINGERPRINT_CLASHES_FIELD_NUMBER: _ClassVar[int]
    DISK_ANSWERED_FIELD_NUMBER: _ClassVar[int]
    SPILLED_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    disk_rows: int
    disk_capacity_rows: int
    disk_slots: int
    disk_bytes: int
    disk_ram_bytes: int
    disk_record_bytes: int
    disk_block_bytes: int
    disk_block_reads: int
    disk_bytes_read: int
    disk_read: int
    disk_read_random: int
    disk_written: int
    disk_hits: int
    disk_misses: int
    disk_evicted: int
    disk_deleted: int
    disk_expired: int
    disk_relocated: int
    disk_fingerprint_clashes: int
    disk_answered: int
    spilled: int
    restored: int
    def __init__(self, disk_rows: _Optional[int] = ..., disk_capacity_rows: _Optional[int] = ..., disk_slots: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., disk_ram_bytes: _Optional[int] = ..., disk_record_bytes: _Optional[int] = ..., disk_block_bytes: _Optional[int] = ..., disk_block_reads: _Optional[int] = ..., disk_bytes_read: _Optional[int] = ..., disk_read: _Optional[int] = ..., disk_read_random: _Optional[int] = ..., disk_written: _Optional[int] = ..., disk_hits: _Optional[int] = ..., disk_misses: _Optional[int] = ..., disk_evicted: _Optional[int] = ..., disk_deleted: _Optional[int] = ..., disk_expired: _Optional[int] = ..., disk_relocated: _Optional[int] = ..., disk_fingerprint_clashes: _Optional[int] = ..., disk_answered: _Optional[int] = ..., spilled: _Optional[int] = ..., restored: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tables", "num_updates")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    NUM_UPDATES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableStats]
    num_updates: int
    def __init__(self, tables: _Optional[_Iterable[_Union[TableStats, _Mapping]]] = ..., num_updates: _Optional[int] = ...) -> None: ...

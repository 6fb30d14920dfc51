from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_KIND_UNSPECIFIED: _ClassVar[KVEventKind]
    KV_EVENT_KIND_STORED: _ClassVar[KVEventKind]
    KV_EVENT_KIND_REMOVED: _ClassVar[KVEventKind]
KV_EVENT_KIND_UNSPECIFIED: KVEventKind
KV_EVENT_KIND_STORED: KVEventKind
KV_EVENT_KIND_REMOVED: KVEventKind

class KVEvent(_message.Message):
    __slots__ = ("tier", "kind", "block_hashes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    kind: KVEventKind
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tier: _Optional[str] = ..., kind: _Optional[_Union[KVEventKind, str]] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("worker_id", "lease", "incarnation", "first_seq", "events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease: bytes
    incarnation: int
    first_seq: int
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, worker_id: _Optional[str] = ..., lease: _Optional[bytes] = ..., incarnation: _Optional[int] = ..., first_seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...

class KVEventAck(_message.Message):
    __slots__ = ("in_order",)
    IN_ORDER_FIELD_NUMBER: _ClassVar[int]
    in_order: bool
    def __init__(self, in_order: _Optional[bool] = ...) -> None: ...

class KVSnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVTierBlocks(_message.Message):
    __slots__ = ("tier", "block_hashes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tier: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class KVSnapshotResponse(_message.Message):
    __slots__ = ("incarnation", "last_seq", "tiers")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    last_seq: int
    tiers: _containers.RepeatedCompositeFieldContainer[KVTierBlocks]
    def __init__(self, incarnation: _Optional[int] = ..., last_seq: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[KVTierBlocks, _Mapping]]] = ...) -> None: ...

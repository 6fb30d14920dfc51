from pdserve.proto.pdserve.v1 import common_pb2 as _common_pb2
from pdserve.proto.pdserve.v1 import kv_events_pb2 as _kv_events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole

class WorkerCapacity(_message.Message):
    __slots__ = ("num_total_blocks", "max_batch_size", "max_queue", "max_model_len")
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    num_total_blocks: int
    max_batch_size: int
    max_queue: int
    max_model_len: int
    def __init__(self, num_total_blocks: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_queue: _Optional[int] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "grpc_address", "model_name", "compatibility_hash", "block_size", "capacity", "kv_backends", "version")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    KV_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    grpc_address: str
    model_name: str
    compatibility_hash: int
    block_size: int
    capacity: WorkerCapacity
    kv_backends: _containers.RepeatedScalarFieldContainer[str]
    version: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., grpc_address: _Optional[str] = ..., model_name: _Optional[str] = ..., compatibility_hash: _Optional[int] = ..., block_size: _Optional[int] = ..., capacity: _Optional[_Union[WorkerCapacity, _Mapping]] = ..., kv_backends: _Optional[_Iterable[str]] = ..., version: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker", "load", "lease", "public_key")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    load: _common_pb2.WorkerLoad
    lease: bytes
    public_key: bytes
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., lease: _Optional[bytes] = ..., public_key: _Optional[bytes] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "worker_timeout_ms", "lease", "router_public_key")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    WORKER_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    ROUTER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    worker_timeout_ms: int
    lease: bytes
    router_public_key: bytes
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., worker_timeout_ms: _Optional[int] = ..., lease: _Optional[bytes] = ..., router_public_key: _Optional[bytes] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "load", "lease")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    load: _common_pb2.WorkerLoad
    lease: bytes
    def __init__(self, worker_id: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., lease: _Optional[bytes] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("heartbeat_interval_ms",)
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id", "reason", "lease")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    lease: bytes
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ..., lease: _Optional[bytes] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("found", "role", "public_key")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    found: bool
    role: WorkerRole
    public_key: bytes
    def __init__(self, found: _Optional[bool] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., public_key: _Optional[bytes] = ...) -> None: ...

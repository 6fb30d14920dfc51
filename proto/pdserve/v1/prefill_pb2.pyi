from pdserve.proto.pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferEndpoint(_message.Message):
    __slots__ = ("backend", "address")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    address: str
    def __init__(self, backend: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class KVHandoff(_message.Message):
    __slots__ = ("transfer_id", "backends", "endpoints", "block_ids", "num_cached_tokens", "deadline_unix_ms", "compatibility_hash", "decode_worker_id", "signature", "lora_name", "lora_digest")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_DIGEST_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    backends: _containers.RepeatedScalarFieldContainer[str]
    endpoints: _containers.RepeatedCompositeFieldContainer[TransferEndpoint]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    deadline_unix_ms: int
    compatibility_hash: int
    decode_worker_id: str
    signature: bytes
    lora_name: str
    lora_digest: str
    def __init__(self, transfer_id: _Optional[str] = ..., backends: _Optional[_Iterable[str]] = ..., endpoints: _Optional[_Iterable[_Union[TransferEndpoint, _Mapping]]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., compatibility_hash: _Optional[int] = ..., decode_worker_id: _Optional[str] = ..., signature: _Optional[bytes] = ..., lora_name: _Optional[str] = ..., lora_digest: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "block_hashes", "sampling", "handoff", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    handoff: KVHandoff
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., handoff: _Optional[_Union[KVHandoff, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrefillTimings(_message.Message):
    __slots__ = ("queue_ms", "compute_ms", "transfer_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    compute_ms: float
    transfer_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_token_logprob", "verdict", "timings", "num_computed_tokens", "num_cached_tokens", "skipped", "prompt_logprobs", "cached_tokens_by_tier")
    class CachedTokensByTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_token_logprob: _common_pb2.TokenLogprob
    verdict: _common_pb2.TransferVerdict
    timings: PrefillTimings
    num_computed_tokens: int
    num_cached_tokens: int
    skipped: bool
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    cached_tokens_by_tier: _containers.ScalarMap[str, int]
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., verdict: _Optional[_Union[_common_pb2.TransferVerdict, _Mapping]] = ..., timings: _Optional[_Union[PrefillTimings, _Mapping]] = ..., num_computed_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., skipped: _Optional[bool] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., cached_tokens_by_tier: _Optional[_Mapping[str, int]] = ...) -> None: ...

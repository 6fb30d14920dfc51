from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class TransferOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_OUTCOME_UNSPECIFIED: _ClassVar[TransferOutcome]
    TRANSFER_OUTCOME_LOCAL: _ClassVar[TransferOutcome]
    TRANSFER_OUTCOME_TRANSFERRED: _ClassVar[TransferOutcome]
    TRANSFER_OUTCOME_RECOMPUTED: _ClassVar[TransferOutcome]
    TRANSFER_OUTCOME_FAILED: _ClassVar[TransferOutcome]
    TRANSFER_OUTCOME_ABORTED: _ClassVar[TransferOutcome]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
TRANSFER_OUTCOME_UNSPECIFIED: TransferOutcome
TRANSFER_OUTCOME_LOCAL: TransferOutcome
TRANSFER_OUTCOME_TRANSFERRED: TransferOutcome
TRANSFER_OUTCOME_RECOMPUTED: TransferOutcome
TRANSFER_OUTCOME_FAILED: TransferOutcome
TRANSFER_OUTCOME_ABORTED: TransferOutcome

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "min_tokens", "logprobs", "top_logprobs", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "constraint", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    min_tokens: int
    logprobs: bool
    top_logprobs: int
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    constraint: Constraint
    prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_object", "json_schema", "regex", "choice", "grammar", "llguidance", "whitespace_pattern")
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    LLGUIDANCE_FIELD_NUMBER: _ClassVar[int]
    WHITESPACE_PATTERN_FIELD_NUMBER: _ClassVar[int]
    json_object: bool
    json_schema: str
    regex: str
    choice: ChoiceList
    grammar: str
    llguidance: str
    whitespace_pattern: str
    def __init__(self, json_object: _Optional[bool] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ..., llguidance: _Optional[str] = ..., whitespace_pattern: _Optional[str] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "accepted_draft_tokens", "rejected_draft_tokens", "draft_steps", "cached_tokens_by_tier")
    class CachedTokensByTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STEPS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    accepted_draft_tokens: int
    rejected_draft_tokens: int
    draft_steps: int
    cached_tokens_by_tier: _containers.ScalarMap[str, int]
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., rejected_draft_tokens: _Optional[int] = ..., draft_steps: _Optional[int] = ..., cached_tokens_by_tier: _Optional[_Mapping[str, int]] = ...) -> None: ...

class FallbackStep(_message.Message):
    __slots__ = ("backend", "reason", "duration_ms")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    reason: str
    duration_ms: float
    def __init__(self, backend: _Optional[str] = ..., reason: _Optional[str] = ..., duration_ms: _Optional[float] = ...) -> None: ...

class TransferVerdict(_message.Message):
    __slots__ = ("outcome", "reason", "backend", "num_bytes", "num_blocks", "duration_ms", "fallbacks", "prefill_worker_id", "prefill_status_code", "transfer_id", "fetch_keys", "num_messages", "layer_send_ms")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    FETCH_KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    LAYER_SEND_MS_FIELD_NUMBER: _ClassVar[int]
    outcome: TransferOutcome
    reason: str
    backend: str
    num_bytes: int
    num_blocks: int
    duration_ms: float
    fallbacks: _containers.RepeatedCompositeFieldContainer[FallbackStep]
    prefill_worker_id: str
    prefill_status_code: str
    transfer_id: str
    fetch_keys: _containers.RepeatedScalarFieldContainer[int]
    num_messages: int
    layer_send_ms: float
    def __init__(self, outcome: _Optional[_Union[TransferOutcome, str]] = ..., reason: _Optional[str] = ..., backend: _Optional[str] = ..., num_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., duration_ms: _Optional[float] = ..., fallbacks: _Optional[_Iterable[_Union[FallbackStep, _Mapping]]] = ..., prefill_worker_id: _Optional[str] = ..., prefill_status_code: _Optional[str] = ..., transfer_id: _Optional[str] = ..., fetch_keys: _Optional[_Iterable[int]] = ..., num_messages: _Optional[int] = ..., layer_send_ms: _Optional[float] = ...) -> None: ...

class RequestTimings(_message.Message):
    __slots__ = ("queue_ms", "prefill_ms", "transfer_ms", "first_decode_ms", "num_migrations", "migration_ms", "resume_prefill_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_MS_FIELD_NUMBER: _ClassVar[int]
    RESUME_PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    prefill_ms: float
    transfer_ms: float
    first_decode_ms: float
    num_migrations: int
    migration_ms: float
    resume_prefill_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., first_decode_ms: _Optional[float] = ..., num_migrations: _Optional[int] = ..., migration_ms: _Optional[float] = ..., resume_prefill_ms: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ("include_tokenizer", "model")
    INCLUDE_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    include_tokenizer: bool
    model: str
    def __init__(self, include_tokenizer: _Optional[bool] = ..., model: _Optional[str] = ...) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model_name", "max_model_len", "block_size", "block_hash_salt", "eos_token_ids", "vocab_size", "tokenizer_json", "chat_template", "bos_token", "eos_token", "special_tokens", "additional_special_tokens")
    class SpecialTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_SALT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADDITIONAL_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_model_len: int
    block_size: int
    block_hash_salt: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    vocab_size: int
    tokenizer_json: bytes
    chat_template: str
    bos_token: str
    eos_token: str
    special_tokens: _containers.ScalarMap[str, str]
    additional_special_tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., block_hash_salt: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., vocab_size: _Optional[int] = ..., tokenizer_json: _Optional[bytes] = ..., chat_template: _Optional[str] = ..., bos_token: _Optional[str] = ..., eos_token: _Optional[str] = ..., special_tokens: _Optional[_Mapping[str, str]] = ..., additional_special_tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("num_queued", "num_running", "num_free_blocks", "num_total_blocks", "kv_backends", "counters", "queued_prompt_tokens", "prefill_tokens_per_s", "num_decoding", "draining", "lora_adapters")
    NUM_QUEUED_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    num_queued: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    kv_backends: _containers.RepeatedCompositeFieldContainer[KVBackendState]
    counters: EngineCounters
    queued_prompt_tokens: int
    prefill_tokens_per_s: float
    num_decoding: int
    draining: bool
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterState]
    def __init__(self, num_queued: _Optional[int] = ..., num_running: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., kv_backends: _Optional[_Iterable[_Union[KVBackendState, _Mapping]]] = ..., counters: _Optional[_Union[EngineCounters, _Mapping]] = ..., queued_prompt_tokens: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., num_decoding: _Optional[int] = ..., draining: _Optional[bool] = ..., lora_adapters: _Optional[_Iterable[_Union[LoraAdapterState, _Mapping]]] = ...) -> None: ...

class LoraAdapterState(_message.Message):
    __slots__ = ("name", "base_model_name", "loaded", "digest", "resident")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    base_model_name: str
    loaded: bool
    digest: str
    resident: bool
    def __init__(self, name: _Optional[str] = ..., base_model_name: _Optional[str] = ..., loaded: _Optional[bool] = ..., digest: _Optional[str] = ..., resident: _Optional[bool] = ...) -> None: ...

class EngineCounters(_message.Message):
    __slots__ = ("prompt_tokens_computed", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits", "preemptions", "steps", "step_seconds", "transfers", "received")
    PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens_computed: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    steps: int
    step_seconds: float
    transfers: _containers.RepeatedCompositeFieldContainer[TransferCounters]
    received: _containers.RepeatedCompositeFieldContainer[PeerTransferCounters]
    def __init__(self, prompt_tokens_computed: _Optional[int] = ..., generation_tokens: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., preemptions: _Optional[int] = ..., steps: _Optional[int] = ..., step_seconds: _Optional[float] = ..., transfers: _Optional[_Iterable[_Union[TransferCounters, _Mapping]]] = ..., received: _Optional[_Iterable[_Union[PeerTransferCounters, _Mapping]]] = ...) -> None: ...

class PeerTransferCounters(_message.Message):
    __slots__ = ("peer", "transfers", "bytes_per_block", "bytes_per_s", "tail_s")
    PEER_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    TAIL_S_FIELD_NUMBER: _ClassVar[int]
    peer: str
    transfers: int
    bytes_per_block: float
    bytes_per_s: float
    tail_s: float
    def __init__(self, peer: _Optional[str] = ..., transfers: _Optional[int] = ..., bytes_per_block: _Optional[float] = ..., bytes_per_s: _Optional[float] = ..., tail_s: _Optional[float] = ...) -> None: ...

class TransferCounters(_message.Message):
    __slots__ = ("backend", "transfers", "bytes", "seconds", "failures")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    backend: str
    transfers: int
    bytes: int
    seconds: float
    failures: int
    def __init__(self, backend: _Optional[str] = ..., transfers: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., failures: _Optional[int] = ...) -> None: ...

class KVBackendState(_message.Message):
    __slots__ = ("name", "usable", "detail")
    NAME_FIELD_NUMBER: _ClassVar[int]
    USABLE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    name: str
    usable: bool
    detail: str
    def __init__(self, name: _Optional[str] = ..., usable: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

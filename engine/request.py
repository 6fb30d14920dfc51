"""A request's life inside one engine: tokens, progress, status, and what it returned."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Sequence

from pdserve.common.errors import InvalidRequestError, PromptTooLongError
from pdserve.common.sampling import check_vocab, resolve_max_tokens
from pdserve.engine.constraints import NO_GRAMMAR
from pdserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # blocks allocated, filled by a connector
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # eos, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    transfer_params: object | None = None  # connector hand-off, opaque to the engine
    remote_prefill: bool = False  # decode side: the prompt's KV arrives from a prefill service
    stream_layers: bool = True  # prefill side: its KV may stream per layer (ConnectorRequest.stream_layers)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # sampling_params.prompt_logprobs: entry i is prompt token i + 1's, given tokens 0..i
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False  # they went out with the first delta
    num_computed_tokens: int = 0  # tokens whose KV is in this request's blocks
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first admission
    num_external_tokens: int = 0  # prompt tokens a connector provided (loaded or received)
    num_loaded_tokens: int = 0  # of those, loaded from a connector's store at admission
    # prompt tokens found cached at first admission, by tier: "device" (the pool), "host", "disk", "redis"
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)  # full prompt blocks, chained (their keys)
    block_digests: list[bytes] = field(default_factory=list)  # their full digests: a cache hit must match
    cache_salt: str = ""  # the tenant salt in the first block's hash (common.block_hash)
    lora_name: str | None = None  # its LoRA adapter (None: the base model); in its block keys
    lora_slot: int = -1  # the device slot holding that adapter while admitted (engine.lora)
    stop_reason: str | int | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    generator: object | None = None  # torch.Generator when seeded
    grammar: object = NO_GRAMMAR  # constraints.GrammarMatcher when sampling_params.constraint
    speculation: object | None = None  # the speculator's state for it (engine.speculation), once made

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def final_length(self) -> int:
        """Its tokens once it runs to max_tokens: what admission reserves blocks for. Within
        the engine's max_model_len (`check_prompt` resolves max_tokens to fit it)."""
        return len(self.prompt_token_ids) + self.sampling_params.max_tokens

    @property
    def waits_for_remote_prefill(self) -> bool:
        """Decode side: its prompt's KV is to arrive from a prefill service (a request resumed
        with tokens generated elsewhere prefills here)."""
        return self.remote_prefill and not self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Its tokens at positions [start, end) (the prompt's, then the output's)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def token_id_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while the prompt's logprobs are wanted and not all computed: every prompt
        position must then run through the model (no cached or received blocks)."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None


def stop_status(request: Request, token: int, stopped_by: str | None, max_model_len: int) -> RequestStatus | None:
    """How `request` ends now that `token` was appended (None: it goes on). `stopped_by`: the
    stop string its detokenizer found, if any. Sets `stop_reason` when a stop ends it."""
    p = request.sampling_params
    n = request.num_output_tokens
    if n >= p.min_tokens:
        if not p.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in p.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if stopped_by is not None:
            request.stop_reason = stopped_by
            return RequestStatus.FINISHED_STOPPED
    if n >= p.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def check_prompt(ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> SamplingParams:
    """A prompt an engine can take with `params`, and `params` with max_tokens resolved
    (common.sampling.resolve_max_tokens): typed errors (InvalidRequestError,
    PromptTooLongError) name what is wrong."""
    if not ids:
        raise InvalidRequestError("the prompt is empty")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise PromptTooLongError(f"the prompt has {len(ids)} tokens; this model's context is {max_model_len}")
    check_vocab(params, vocab_size)
    return resolve_max_tokens(params, len(ids), max_model_len)


def check_resumed(resumed: Sequence[int], params: SamplingParams, vocab_size: int) -> list[int]:
    """The tokens a request already generated elsewhere, as ints: some of max_tokens must be
    left, each a token of the vocabulary."""
    tokens = [int(t) for t in resumed]
    if not tokens:
        return tokens
    if len(tokens) >= params.max_tokens:
        raise InvalidRequestError(f"{len(tokens)} resumed tokens leave nothing of max_tokens "
                                  f"({params.max_tokens}) to generate")
    if min(tokens) < 0 or max(tokens) >= vocab_size:
        raise InvalidRequestError(f"resumed token ids must be in [0, {vocab_size})")
    return tokens

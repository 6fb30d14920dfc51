"""Check a request's sampling parameters against the model and resolve their defaults.

The same rules apply to HTTP and gRPC requests (both arrive here as SamplingParams); what
goes to decode is fully resolved (every optional field set, except seed).
"""
from __future__ import annotations

from pdserve.common.errors import InvalidRequestError
from pdserve.proto.pdserve.v1 import common_pb2
from pdserve.router.prompt import check_token_ids

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 256  # each is checked here and compared with every token decode samples
CONTEXT_CODE = "context_length_exceeded"


def _invalid(message: str, param: str, code: str | None = None) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code=code)


def check_prompt_fits(num_prompt_tokens: int, max_model_len: int, param: str) -> None:
    """The prompt must leave room for at least one generated token."""
    if num_prompt_tokens >= max_model_len:
        raise _invalid(f"the prompt has {num_prompt_tokens} tokens; this model's context is "
                       f"{max_model_len} tokens and generation needs at least one more", param, CONTEXT_CODE)


def resolve_sampling(sampling: common_pb2.SamplingParams, num_prompt_tokens: int, max_model_len: int,
                     vocab_size: int) -> common_pb2.SamplingParams:
    """A validated copy of `sampling` with every default filled in; INVALID_ARGUMENT otherwise."""
    room = max_model_len - num_prompt_tokens
    resolved = common_pb2.SamplingParams()
    resolved.CopyFrom(sampling)
    if sampling.HasField("max_tokens"):
        if sampling.max_tokens < 1:
            raise _invalid("max_tokens must be at least 1", "max_tokens")
        if sampling.max_tokens > room:
            raise _invalid(f"max_tokens {sampling.max_tokens} plus the prompt's {num_prompt_tokens} tokens "
                           f"exceeds this model's context of {max_model_len} tokens", "max_tokens", CONTEXT_CODE)
    else:
        resolved.max_tokens = room
    if sampling.HasField("temperature"):
        if not 0.0 <= sampling.temperature <= 2.0:
            raise _invalid(f"temperature must be in [0, 2], got {sampling.temperature}", "temperature")
    else:
        resolved.temperature = 1.0
    if sampling.HasField("top_p"):
        if not 0.0 < sampling.top_p <= 1.0:
            raise _invalid(f"top_p must be in (0, 1], got {sampling.top_p}", "top_p")
    else:
        resolved.top_p = 1.0
    if not sampling.HasField("top_k"):
        resolved.top_k = 0
    if len(sampling.stop) > MAX_STOP_STRINGS:
        raise _invalid(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    for stop in sampling.stop:
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise _invalid(f"stop strings must be 1 to {MAX_STOP_CHARS} characters", "stop")
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise _invalid(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", "stop_token_ids")
    check_token_ids(sampling.stop_token_ids, vocab_size, "stop_token_ids")
    if sampling.min_tokens > resolved.max_tokens:
        raise _invalid("min_tokens must not exceed max_tokens", "min_tokens")
    if sampling.top_logprobs > MAX_TOP_LOGPROBS:
        raise _invalid(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    if sampling.top_logprobs and not sampling.logprobs:
        raise _invalid("top_logprobs needs logprobs", "top_logprobs")
    if sampling.HasField("prompt_logprobs") and sampling.prompt_logprobs > MAX_TOP_LOGPROBS:
        raise _invalid(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "prompt_logprobs")
    _check_penalties(sampling, resolved, vocab_size)
    return resolved


def _check_penalties(sampling: common_pb2.SamplingParams, resolved: common_pb2.SamplingParams,
                     vocab_size: int) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        if not -2.0 <= value <= 2.0:
            raise _invalid(f"{name} must be in [-2, 2], got {value:g}", name)
    if sampling.HasField("repetition_penalty"):
        if not 0.0 < sampling.repetition_penalty <= 100.0:
            raise _invalid(f"repetition_penalty must be in (0, 100], got {sampling.repetition_penalty:g}",
                           "repetition_penalty")
    else:
        resolved.repetition_penalty = 1.0
    if len(sampling.logit_bias) > MAX_LOGIT_BIAS:
        raise _invalid(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    check_token_ids(list(sampling.logit_bias), vocab_size, "logit_bias")
    if any(not -100.0 <= b <= 100.0 for b in sampling.logit_bias.values()):
        raise _invalid("logit_bias values must be in [-100, 100]", "logit_bias")

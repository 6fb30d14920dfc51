"""Check a request's sampling parameters against the sampling table and resolve their defaults.

The table (common.sampling) is the engine's too, so a value refused here is one the engine
would refuse, with the same error. HTTP and gRPC requests both arrive here as
SamplingParams; what goes to decode is resolved: every field of the table set, except those
whose default is "none" (seed, top_logprobs, prompt_logprobs).
"""
from __future__ import annotations

from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling import BOUNDS, SamplingValues, check_vocab, resolve_max_tokens
from pdserve.proto.pdserve.v1 import common_pb2

CONTEXT_CODE = "context_length_exceeded"


def check_prompt_fits(num_prompt_tokens: int, max_model_len: int, param: str) -> None:
    """The prompt must leave room for at least one generated token."""
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(f"the prompt has {num_prompt_tokens} tokens; this model's context is "
                                  f"{max_model_len} tokens and generation needs at least one more",
                                  param=param, code=CONTEXT_CODE)


def resolve_sampling(sampling: common_pb2.SamplingParams, num_prompt_tokens: int, max_model_len: int,
                     vocab_size: int) -> common_pb2.SamplingParams:
    """A checked copy of `sampling` with the table's defaults and max_tokens filled in;
    INVALID_ARGUMENT otherwise."""
    if sampling.top_logprobs and not sampling.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs", param="top_logprobs")
    values = resolve_max_tokens(SamplingValues.from_message(sampling), num_prompt_tokens, max_model_len)
    check_vocab(values, vocab_size)
    resolved = common_pb2.SamplingParams()
    resolved.CopyFrom(sampling)
    for name, bounds in BOUNDS.items():
        value = getattr(values, name)
        if value is not None:
            setattr(resolved, bounds.request_name or name, value)
    return resolved

"""The sampling table: each sampling field's default and the values it may take.

`SamplingValues` is the table, one dataclass field per row; a numeric row carries its
`Bounds`. The router builds one from every request (HTTP and gRPC alike) and the engine's
`SamplingParams` extends it, so both refuse the same values with the same
`InvalidRequestError` (HTTP 400 in OpenAI's shape, gRPC INVALID_ARGUMENT), its `param`
naming the request field. The proto names each field as its row, and `from_message` is the
one conversion from it: a field left unset takes the row's default, nothing else adds one.

max_tokens has no fixed default: unset, it is the room left in the context (max_model_len -
prompt tokens) on every path (`resolve_max_tokens`, once the prompt's length is known), but
OpenAI's legacy `/v1/completions`, whose API default is COMPLETIONS_MAX_TOKENS.

A new sampling parameter is a proto field, a row here, and the sampler code that obeys it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pdserve.common.errors import InvalidRequestError, PromptTooLongError

MAX_TOP_LOGPROBS = 20
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (vLLM and SGLang keep it too)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256  # each is compared with every token decode samples
MAX_LOGIT_BIAS = 1024
_COUNT = 2**32 - 1  # the widest count the wire holds (uint32)
_INT64 = (-(2**63), 2**63 - 1)


def _num(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else repr(value)


@dataclass(frozen=True, slots=True)
class Bounds:
    """The values a numeric row allows: lo..hi, lo itself excluded when `lo_open`."""
    lo: float
    hi: float
    lo_open: bool = False
    integer: bool = False
    request_name: str = ""  # the field's name in requests (proto, OpenAI chat) when not the row's

    def __str__(self) -> str:
        return f"{'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}]"

    def check(self, value: Any, param: str) -> int | float:
        """`value` as the row's type, or InvalidRequestError naming `param`."""
        number = int if self.integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, number):
            raise InvalidRequestError(f"{param} must be {'an integer' if self.integer else 'a number'}, "
                                      f"got {value!r}", param=param)
        above_lo = self.lo < value if self.lo_open else self.lo <= value
        if not (above_lo and value <= self.hi):  # NaN fails both
            raise InvalidRequestError(f"{param} must be in {self}, got {_num(value)}", param=param)
        return value if self.integer else float(value)


LOGIT_BIAS = Bounds(-100.0, 100.0)


def row(default: Any, lo: float, hi: float, *, lo_open: bool = False, integer: bool = False,
        request_name: str = "") -> Any:
    """A table field with its default and its `Bounds`."""
    return field(default=default, metadata={"bounds": Bounds(lo, hi, lo_open, integer, request_name)})


@dataclass(frozen=True, slots=True)
class SamplingValues:
    """One request's sampling values, checked on construction (`check_sampling`). None: unset."""
    max_tokens: int | None = row(None, 1, _COUNT, integer=True)  # unset: the room left in the context
    min_tokens: int = row(0, 0, _COUNT, integer=True)  # EOS and stop ids end nothing before it; <= max_tokens
    temperature: float = row(1.0, 0.0, 2.0)  # 0: greedy
    top_p: float = row(1.0, 0.0, 1.0, lo_open=True)  # nucleus mass kept; 1: off
    top_k: int = row(0, 0, _COUNT, integer=True)  # 0: off
    seed: int | None = row(None, *_INT64, integer=True)  # per-request draws; unset: the engine's generator
    presence_penalty: float = row(0.0, -2.0, 2.0)  # minus this once for every token already generated
    frequency_penalty: float = row(0.0, -2.0, 2.0)  # minus this times each token's output count
    repetition_penalty: float = row(1.0, 0.0, 100.0, lo_open=True)  # transformers' rule, prompt and output
    # the chosen token's logprob and this many alternatives (requests: top_logprobs with logprobs); unset: none
    logprobs: int | None = row(None, 0, MAX_TOP_LOGPROBS, integer=True, request_name="top_logprobs")
    prompt_logprobs: int | None = row(None, 0, MAX_TOP_LOGPROBS, integer=True)  # as logprobs, per prompt token
    stop: tuple[str, ...] = ()  # stop strings; not part of the returned text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in LOGIT_BIAS)

    def __post_init__(self) -> None:
        _normalize(self)
        check_sampling(self)

    @classmethod
    def from_message(cls, message: Any, **extra: Any):
        """`cls` from a pdserve.v1.SamplingParams message, read by field name (this module
        imports no proto); a field the message leaves unset takes its row's default.
        `extra`: fields only `cls` has."""
        declared = message.DESCRIPTOR.fields_by_name
        table = {}
        for name, bounds in BOUNDS.items():
            wire = bounds.request_name or name
            if not declared[wire].has_presence or message.HasField(wire):
                table[name] = getattr(message, wire)
        table["logprobs"] = message.top_logprobs if message.logprobs else None
        return cls(**table, stop=tuple(message.stop), stop_token_ids=tuple(message.stop_token_ids),
                   ignore_eos=message.ignore_eos, logit_bias=tuple(sorted(message.logit_bias.items())), **extra)


BOUNDS: dict[str, Bounds] = {f.name: f.metadata["bounds"] for f in dataclasses.fields(SamplingValues)
                             if "bounds" in f.metadata}


def _normalize(values: SamplingValues) -> None:
    """Lists as tuples: one stop string as a tuple of one, logit_bias from a dict or pairs."""
    stop = (values.stop,) if isinstance(values.stop, str) else values.stop
    object.__setattr__(values, "stop", _as_tuple(stop, lambda s: s, "stop"))
    object.__setattr__(values, "stop_token_ids", _as_tuple(values.stop_token_ids, int, "stop_token_ids"))
    bias = values.logit_bias.items() if isinstance(values.logit_bias, dict) else values.logit_bias
    pairs = _as_tuple(bias, lambda pair: (int(pair[0]), float(pair[1])), "logit_bias")
    object.__setattr__(values, "logit_bias", tuple(dict(pairs).items()))  # one bias per token: the last


def _as_tuple(items: Any, convert: Any, param: str) -> tuple:
    try:
        return tuple(convert(item) for item in items)
    except (TypeError, ValueError, IndexError):
        raise InvalidRequestError(f"{param} has a value of the wrong type", param=param) from None


def check_sampling(values: SamplingValues) -> None:
    """Raise InvalidRequestError, `param` naming the request field, unless every value is one
    the table allows (None: unset)."""
    for name, bounds in BOUNDS.items():
        value = getattr(values, name)
        if value is not None:
            bounds.check(value, bounds.request_name or name)
    if values.max_tokens is not None and values.min_tokens > values.max_tokens:
        raise InvalidRequestError("min_tokens must not exceed max_tokens", param="min_tokens")
    if len(values.stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    if any(not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS for s in values.stop):
        raise InvalidRequestError(f"stop strings must be 1 to {MAX_STOP_CHARS} characters", param="stop")
    if len(values.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", param="stop_token_ids")
    if len(values.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
    for _, bias in values.logit_bias:
        if not (math.isfinite(bias) and LOGIT_BIAS.lo <= bias <= LOGIT_BIAS.hi):
            raise InvalidRequestError(f"logit_bias values must be in {LOGIT_BIAS}, got {_num(bias)}",
                                      param="logit_bias")
    check_vocab(values, None)


def check_vocab(values: SamplingValues, vocab_size: int | None) -> None:
    """Every token id `values` names is in [0, vocab_size) (None: any size)."""
    for param, ids in (("stop_token_ids", values.stop_token_ids), ("logit_bias", [t for t, _ in values.logit_bias])):
        for token_id in ids:
            if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                size = "" if vocab_size is None else f" (size {vocab_size})"
                raise InvalidRequestError(f"{param}: token id {token_id} is outside the vocabulary{size}",
                                          param=param)


V = TypeVar("V", bound=SamplingValues)


def resolve_max_tokens(values: V, num_prompt_tokens: int, max_model_len: int) -> V:
    """`values` with max_tokens set: unset, it is the room left in the context; set, it must
    fit that room (PromptTooLongError). The callers first check that the prompt leaves room
    for one token, naming the prompt."""
    room = max_model_len - num_prompt_tokens
    if values.max_tokens is None:
        return dataclasses.replace(values, max_tokens=room)  # checked again: min_tokens <= max_tokens
    if values.max_tokens > room:
        raise PromptTooLongError(f"max_tokens {values.max_tokens} plus the prompt's {num_prompt_tokens} tokens "
                                 f"exceeds this model's context of {max_model_len} tokens", param="max_tokens")
    return values

"""OpenAI request bodies -> GenerateRequest.

Only the JSON shape is checked here (types, choice counts, unsupported options, ranges the
proto cannot hold); the sampling table's value rules, shared with gRPC and the engine, are
applied by `validation.py`. A table field the body names otherwise than the table
(max_completion_tokens, top_k's -1, logprobs) is checked by its row here, so the error names
the body's field; every other numeric row is read under its own name.

Unknown top-level fields are ignored, as vLLM ignores them (OpenAI clients send extras), but
each request lists them (`OpenAIRequest.ignored_fields`: the response's
`pdserve.ignored_fields`) and `IgnoredFieldLog` logs each name once, so a misspelt option is visible.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import FieldDescriptor

from pdserve.common.block_hash import check_cache_salt
from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling import BOUNDS, COMPLETIONS_MAX_TOKENS
from pdserve.proto.pdserve.v1 import common_pb2, generation_pb2
from pdserve.router.guided import STRUCTURED_FIELDS, read_guided
from pdserve.router.tools import ToolMode, apply_tools, history_tool_calls, read_tools, set_response_format

log = logging.getLogger("pdserve.router.http")

_UINT32_MAX = 2**32 - 1
_INT64 = (-(2**63), 2**63 - 1)
_WIRE_INTS = {FieldDescriptor.CPPTYPE_UINT32: (0, _UINT32_MAX), FieldDescriptor.CPPTYPE_INT64: _INT64}
MAX_CHOICES = 128  # n * number of prompts: one request fans out into at most this many
# numeric rows of the sampling table a body names as the table does (the others are read apart)
_TABLE_FIELDS = tuple(name for name in BOUNDS if name not in ("max_tokens", "top_k", "logprobs"))
_COMMON_FIELDS = frozenset(_TABLE_FIELDS) | frozenset((
    "model", "stream", "stream_options", "top_k", "stop", "stop_token_ids", "ignore_eos", "logit_bias",
    "n", "best_of", "max_tokens", "logprobs", "user", "response_format", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "guided_json_object", "guided_whitespace_pattern",
    "structured_outputs", "cache_salt", "return_tokens_as_token_ids"))
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                "parallel_tool_calls"}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "suffix"}


@dataclass(frozen=True, slots=True)
class Choice:
    """One generation of a fanned-out request (n > 1, best_of, a list of prompts)."""
    prompt_index: int
    copy_index: int  # 0 .. best_of - 1
    request: generation_pb2.GenerateRequest


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    request: generation_pb2.GenerateRequest
    stream: bool
    include_usage: bool  # stream_options.include_usage
    model: str  # as the client named it, echoed in responses
    n: int = 1
    best_of: int = 1  # >= n; the n with the highest total logprob are returned
    prompts: tuple[generation_pb2.GenerateRequest, ...] = ()  # completions: one request per prompt
    tool_mode: ToolMode = ToolMode()  # chat with tools: how the answer is read (tools.py)
    ignored_fields: tuple[str, ...] = ()  # top-level fields this server does not act on, sorted
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs was asked for (answered in its shape)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens read "token_id:N"

    def choices(self) -> list[Choice]:
        """The generations to run: best_of per prompt; a seeded request's k-th copy gets
        seed + k, so n choices differ and stay reproducible."""
        out = []
        for p, base in enumerate(self.prompts or (self.request,)):
            for k in range(self.best_of):
                copy = generation_pb2.GenerateRequest()
                copy.CopyFrom(base)
                if k and copy.sampling.HasField("seed"):
                    copy.sampling.seed = (copy.sampling.seed + k) % 2**63
                out.append(Choice(p, k, copy))
        return out


def _invalid(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


class IgnoredFieldLog:
    """Logs each ignored field name once (per router process), with the endpoint that got it."""

    MAX_NAMES = 1024  # a client inventing names cannot grow this without bound

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def note(self, fields: tuple[str, ...], endpoint: str) -> None:
        for name in fields:
            if name not in self._seen and len(self._seen) < self.MAX_NAMES:
                self._seen.add(name)
                log.warning("%s: ignoring unknown request field %r (listed in pdserve.ignored_fields)",
                            endpoint, name[:100])


def _ignored(raw: dict[str, Any], known: frozenset[str]) -> tuple[str, ...]:
    """Top-level fields not in `known`, and keys of `structured_outputs` this server does not read
    (as "structured_outputs.<key>"), sorted."""
    names = [k for k in raw if k not in known]
    structured = raw.get("structured_outputs")
    if isinstance(structured, dict):
        names += [f"structured_outputs.{k}" for k in structured if k not in STRUCTURED_FIELDS]
    return tuple(sorted(names))[:64]


class _Body:
    """Typed reads of one JSON object; each failure names its field."""

    def __init__(self, body: dict[str, Any]) -> None:
        self._body = body

    def has(self, name: str) -> bool:
        return self._body.get(name) is not None

    def raw(self, name: str) -> Any:
        return self._body.get(name)

    def int(self, name: str, lo: int, hi: int) -> int | None:
        value = self._body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise _invalid(f"'{name}' must be an integer", name)
        if not lo <= value <= hi:
            raise _invalid(f"'{name}' must be in [{lo}, {hi}], got {value}", name)
        return value

    def number(self, name: str) -> float | None:
        value = self._body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _invalid(f"'{name}' must be a number", name)
        return float(value)

    def row(self, name: str, row: str) -> int | float | None:
        """`name`, read as the sampling table's `row` and checked by it (the error names `name`)."""
        value = self._body.get(name)
        return None if value is None else BOUNDS[row].check(value, name)

    def bool(self, name: str) -> bool | None:
        value = self._body.get(name)
        if value is not None and not isinstance(value, bool):
            raise _invalid(f"'{name}' must be true or false", name)
        return value

    def str(self, name: str) -> str | None:
        value = self._body.get(name)
        if value is not None and not isinstance(value, str):
            raise _invalid(f"'{name}' must be a string", name)
        return value

    def unsupported(self, name: str, allowed: tuple[Any, ...]) -> None:
        value = self._body.get(name)
        if value is not None and value not in allowed:
            raise _invalid(f"'{name}' = {value!r} is not supported", name)


def _num_choices(body: _Body, stream: bool, num_prompts: int) -> tuple[int, int]:
    """(n, best_of), bounded so that best_of * prompts <= MAX_CHOICES."""
    n = body.int("n", 1, MAX_CHOICES) or 1
    best_of = body.int("best_of", 1, MAX_CHOICES) or n
    if best_of < n:
        raise _invalid("'best_of' must be at least 'n'", "best_of")
    if best_of > n and stream:
        raise _invalid("'best_of' > 'n' cannot be streamed", "best_of")
    if best_of * num_prompts > MAX_CHOICES:
        raise _invalid(f"at most {MAX_CHOICES} generations per request (n or best_of times prompts)", "n")
    return n, best_of


def _common(body: _Body, sampling: common_pb2.SamplingParams) -> tuple[bool, bool]:
    """Fields both endpoints share; returns (stream, include_usage)."""
    _table_fields(body, sampling)
    _logit_bias(body, sampling)
    top_k = body.raw("top_k")
    if top_k is not None:
        sampling.top_k = 0 if top_k == -1 and type(top_k) is int else body.row("top_k", "top_k")  # -1: vLLM's off
    sampling.stop.extend(_stop_strings(body.raw("stop")))
    stop_ids = body.raw("stop_token_ids")
    if stop_ids is not None:
        sampling.stop_token_ids.extend(_token_list(stop_ids, "stop_token_ids"))
    sampling.ignore_eos = bool(body.bool("ignore_eos"))
    stream = bool(body.bool("stream"))
    options = body.raw("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _invalid("'stream_options' must be an object", "stream_options")
    if options is not None and not stream:
        raise _invalid("'stream_options' is only allowed with stream=true", "stream_options")
    return stream, bool(options and options.get("include_usage"))


def _table_fields(body: _Body, sampling: common_pb2.SamplingParams) -> None:
    """The table's fields named as the table names them: typed and sized for the wire here,
    their values checked by validation.py."""
    declared = sampling.DESCRIPTOR.fields_by_name
    for name in _TABLE_FIELDS:
        wire_int = _WIRE_INTS.get(declared[name].cpp_type)
        value = body.number(name) if wire_int is None else body.int(name, *wire_int)
        if value is not None:
            setattr(sampling, name, value)


def _logit_bias(body: _Body, sampling: common_pb2.SamplingParams) -> None:
    """Token id -> bias (the values' range: validation.py)."""
    bias = body.raw("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise _invalid("'logit_bias' must be an object of token id -> bias", "logit_bias")
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) <= _UINT32_MAX):
            raise _invalid(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _invalid("'logit_bias' values must be numbers", "logit_bias")
        sampling.logit_bias[int(key)] = float(value)


def _stop_strings(value: Any) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _invalid("'stop' must be a string or a list of strings", "stop")
    return items


def _token_list(value: Any, param: str) -> list[int]:
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _UINT32_MAX for t in value):
        raise _invalid(f"'{param}' must be a list of non-negative token ids", param)
    return value


def _model(body: _Body) -> str:
    model = body.str("model")
    if not model:
        raise _invalid("'model' is required", "model")
    return model


def _max_tokens(body: _Body, *names: str) -> int | None:
    """The first of `names` the body sets; unset, the table's default (the room left in the context)."""
    for name in names:
        value = body.row(name, "max_tokens")
        if value is not None:
            return value
    return None


def parse_completion(raw: dict[str, Any]) -> OpenAIRequest:
    body = _Body(raw)
    model = _model(body)
    request = generation_pb2.GenerateRequest(model=model, session_id=body.str("user") or "",
                                             cache_salt=check_cache_salt(body.str("cache_salt") or ""))
    prompts = _prompts(raw.get("prompt"))
    request.echo = echo = bool(body.bool("echo"))
    body.unsupported("suffix", ("",))
    set_response_format(raw.get("response_format"), request.sampling)
    read_guided(raw, request.sampling)
    stream, include_usage = _common(body, request.sampling)
    n, best_of = _num_choices(body, stream, len(prompts))
    max_tokens = _max_tokens(body, "max_tokens")
    request.sampling.max_tokens = COMPLETIONS_MAX_TOKENS if max_tokens is None else max_tokens
    logprobs = body.row("logprobs", "logprobs")
    if logprobs is not None:
        request.sampling.logprobs = True
        request.sampling.top_logprobs = logprobs
        if echo and not request.sampling.HasField("prompt_logprobs"):  # the echoed prompt's tokens too
            request.sampling.prompt_logprobs = logprobs
    requests = []
    for prompt in prompts:
        one = generation_pb2.GenerateRequest()
        one.CopyFrom(request)
        if isinstance(prompt, str):
            one.prompt = prompt
        else:
            one.token_ids.ids.extend(prompt)
        requests.append(one)
    return OpenAIRequest(requests[0], stream, include_usage, model, n, best_of, tuple(requests),
                         ignored_fields=_ignored(raw, COMPLETION_FIELDS), prompt_logprobs=body.has("prompt_logprobs"),
                         tokens_as_ids=bool(body.bool("return_tokens_as_token_ids")))


def _prompts(prompt: Any) -> list[str | list[int]]:
    """A string, a list of token ids, or a non-empty list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [_token_list(prompt, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_CHOICES:
            raise _invalid(f"at most {MAX_CHOICES} prompts per request", "prompt")
        out = []
        for p in prompt:
            if isinstance(p, list) and not p:
                raise _invalid("a prompt of token ids must not be empty", "prompt")
            out.append(p if isinstance(p, str) else _token_list(p, "prompt"))
        return out
    if prompt is None:
        raise _invalid("'prompt' is required", "prompt")
    raise _invalid("'prompt' must be a string, a list of token ids, or a list of those", "prompt")


def parse_chat(raw: dict[str, Any]) -> OpenAIRequest:
    body = _Body(raw)
    model = _model(body)
    request = generation_pb2.GenerateRequest(model=model, session_id=body.str("user") or "",
                                             cache_salt=check_cache_salt(body.str("cache_salt") or ""))
    messages = raw.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("'messages' must be a non-empty list", "messages")
    request.chat.messages.extend(chat_messages(messages))
    set_response_format(raw.get("response_format"), request.sampling)
    read_guided(raw, request.sampling)
    read_tools(raw, request)
    tool_mode = apply_tools(request)
    stream, include_usage = _common(body, request.sampling)
    n, best_of = _num_choices(body, stream, 1)
    max_tokens = _max_tokens(body, "max_completion_tokens", "max_tokens")
    if max_tokens is not None:
        request.sampling.max_tokens = max_tokens
    request.sampling.logprobs = bool(body.bool("logprobs"))
    top_logprobs = body.row("top_logprobs", "logprobs")
    if top_logprobs:
        request.sampling.top_logprobs = top_logprobs
    return OpenAIRequest(request, stream, include_usage, model, n, best_of, tool_mode=tool_mode,
                         ignored_fields=_ignored(raw, CHAT_FIELDS), prompt_logprobs=body.has("prompt_logprobs"),
                         tokens_as_ids=bool(body.bool("return_tokens_as_token_ids")))


def chat_messages(value: Any) -> list[generation_pb2.ChatMessage]:
    """The ChatMessages of an OpenAI `messages` list (tool calls and tool results kept)."""
    if not isinstance(value, list) or not value:
        raise _invalid("'messages' must be a non-empty list", "messages")
    return [_chat_message(m) for m in value]


def _chat_message(message: Any) -> generation_pb2.ChatMessage:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _invalid("each message must be an object with a string 'role'", "messages")
    out = generation_pb2.ChatMessage(role=message["role"], content=_content(message.get("content")))
    if message.get("tool_calls") is not None:
        out.tool_calls.extend(history_tool_calls(message["tool_calls"]))
    for name in ("tool_call_id", "name"):
        value = message.get(name)
        if value is not None and not isinstance(value, str):
            raise _invalid(f"a message's '{name}' must be a string", "messages")
        setattr(out, name, value or "")
    return out


def _content(content: Any) -> str:
    if content is None:
        content = ""
    elif isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _invalid("only text content parts are supported", "messages")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise _invalid("message 'content' must be a string or a list of text parts", "messages")
    return content

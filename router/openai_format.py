"""GenerateResponse messages -> OpenAI JSON (whole responses and SSE chunks).

Besides OpenAI's fields every response carries a non-standard `pdserve` object:
`{"request_id", "routing": {...}, "transfer": {...}, "timings": {...}, "cached_tokens_by_tier": {...}}`
(what is known at that point of the stream; the transfer verdict on the first and the last
chunk, the cached tokens by tier on the last). All but the request id are an admin's
(`security.client_keys.Scope`): for anyone else the frontend leaves them out of the messages,
and so they are left out here; usage's cached_tokens (the total) stays, as OpenAI sends it.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from pdserve.proto.pdserve.v1 import common_pb2, generation_pb2
from pdserve.router.tool_stream import CallStream
from pdserve.router.tools import ToolMode, may_be_calls, stream_deltas, tool_calls

FINISH_REASONS = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                  common_pb2.FINISH_REASON_ABORT: "abort"}

TokenText = Callable[[int], str]  # id -> text, for logprobs entries decode left empty


def finish_reason(response: generation_pb2.GenerateResponse) -> str | None:
    return FINISH_REASONS.get(response.finish_reason)


def usage_json(usage: common_pb2.Usage) -> dict[str, Any]:
    out = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
           "total_tokens": usage.prompt_tokens + usage.completion_tokens,
           "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}
    if usage.draft_steps:  # speculative decoding checked drafts: OpenAI's predicted-output counts
        out["completion_tokens_details"] = {"accepted_prediction_tokens": usage.accepted_draft_tokens,
                                            "rejected_prediction_tokens": usage.rejected_draft_tokens}
    return out


def verdict_json(verdict: common_pb2.TransferVerdict) -> dict[str, Any]:
    outcome = common_pb2.TransferOutcome.Name(verdict.outcome).removeprefix("TRANSFER_OUTCOME_").lower()
    return {"outcome": outcome, "reason": verdict.reason, "backend": verdict.backend,
            "bytes": verdict.num_bytes, "blocks": verdict.num_blocks, "duration_ms": verdict.duration_ms,
            "fallbacks": [{"backend": f.backend, "reason": f.reason, "duration_ms": f.duration_ms}
                          for f in verdict.fallbacks],
            "prefill_worker_id": verdict.prefill_worker_id, "prefill_status_code": verdict.prefill_status_code,
            "transfer_id": verdict.transfer_id, "messages": verdict.num_messages,
            "layer_send_ms": verdict.layer_send_ms}


def routing_json(routing: generation_pb2.RoutingInfo) -> dict[str, Any]:
    return {"decode_worker_id": routing.decode_worker_id, "decode_reason": routing.decode_reason,
            "prefill_worker_id": routing.prefill_worker_id, "prefill_reason": routing.prefill_reason,
            "prompt_tokens": routing.num_prompt_tokens,
            "matched_prefix_tokens": routing.num_matched_prefix_tokens,
            "predicted_ttft_s": {"local": round(routing.predicted_local_s, 4),
                                 "remote": round(routing.predicted_remote_s, 4),
                                 "transfer": round(routing.predicted_transfer_s, 4)}}


def timings_json(timings: common_pb2.RequestTimings) -> dict[str, Any]:
    out = {"queue_ms": timings.queue_ms, "prefill_ms": timings.prefill_ms,
           "transfer_ms": timings.transfer_ms, "first_decode_ms": timings.first_decode_ms}
    if timings.num_migrations:  # what moving the stream to other decodes cost (router.stream_timings)
        out.update(migrations=timings.num_migrations, migration_ms=timings.migration_ms,
                   resume_prefill_ms=timings.resume_prefill_ms)
    return out


def pdserve_json(response: generation_pb2.GenerateResponse) -> dict[str, Any]:
    out: dict[str, Any] = {"request_id": response.request_id}
    if response.HasField("routing"):
        out["routing"] = routing_json(response.routing)
    if response.HasField("transfer"):
        out["transfer"] = verdict_json(response.transfer)
    if response.HasField("timings"):
        out["timings"] = timings_json(response.timings)
    if response.usage.cached_tokens_by_tier:  # an admin's: where the cached prompt tokens were found
        out["cached_tokens_by_tier"] = dict(sorted(response.usage.cached_tokens_by_tier.items()))
    return out


class TokenIds:
    """The TokenText of vLLM's return_tokens_as_token_ids: every token reads "token_id:N",
    whatever text the worker sent for it."""

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"


def _text(token_id: int, token: str, token_text: TokenText) -> str:
    if isinstance(token_text, TokenIds):
        return token_text(token_id)
    return token or token_text(token_id)


def _token_json(token_id: int, logprob: float, token: str, token_text: TokenText) -> dict[str, Any]:
    text = _text(token_id, token, token_text)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[common_pb2.TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    return {"content": [{**_token_json(e.token_id, e.logprob, e.token, token_text),
                         "top_logprobs": [_token_json(t.token_id, t.logprob, t.token, token_text)
                                          for t in e.top_logprobs]} for e in entries]}


def completion_logprobs(entries: list[common_pb2.TokenLogprob], token_text: TokenText,
                        text_offset: int) -> dict[str, Any]:
    tokens, offsets = [], []
    for e in entries:
        tokens.append(_text(e.token_id, e.token, token_text))
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_text(t.token_id, t.token, token_text): t.logprob for t in e.top_logprobs}
                             for e in entries],
            "text_offset": offsets}


def echoed_logprobs(prompt: "EchoedPrompt", entries: list[common_pb2.TokenLogprob],
                    token_text: TokenText) -> dict[str, Any]:
    """Completions with echo and logprobs: the prompt's tokens first (the first has no logprob,
    as in OpenAI's answer), then `entries`, whose offsets start after the prompt's text."""
    prompt.listed = True
    first = token_text(prompt.first_token_id)
    ours = completion_logprobs(prompt.logprobs, token_text, len(first))
    rest = completion_logprobs(entries, token_text, len(prompt.text))
    return {"tokens": [first] + ours["tokens"] + rest["tokens"],
            "token_logprobs": [None] + ours["token_logprobs"] + rest["token_logprobs"],
            "top_logprobs": [None] + ours["top_logprobs"] + rest["top_logprobs"],
            "text_offset": [0] + ours["text_offset"] + rest["text_offset"]}


def vllm_prompt_logprobs(entries: list[common_pb2.TokenLogprob], token_text: TokenText) -> list[Any]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token a map of
    token id -> {logprob, decoded_token} holding the token itself and its top alternatives."""
    out: list[Any] = [None]
    for e in entries:
        position = {str(t.token_id): {"logprob": t.logprob, "decoded_token": _text(t.token_id, t.token, token_text)}
                    for t in e.top_logprobs}
        position[str(e.token_id)] = {"logprob": e.logprob, "decoded_token": _text(e.token_id, e.token, token_text)}
        out.append(position)
    return out


@dataclass(slots=True)
class EchoedPrompt:
    """What the first messages of an echoed request say of its prompt."""

    text: str = ""
    first_token_id: int | None = None  # None: the prompt was not sent back
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)  # tokens 1..
    listed: bool = False  # streamed: its tokens went out in a chunk's logprobs

    def add(self, response: generation_pb2.GenerateResponse) -> None:
        if response.prompt_token_ids:
            self.text, self.first_token_id = response.prompt_text, response.prompt_token_ids[0]
        self.logprobs.extend(response.prompt_logprobs)


@dataclass(slots=True)
class Collected:
    """A whole stream gathered for a non-streaming answer."""

    text: list[str] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    last: generation_pb2.GenerateResponse | None = None
    pdserve: dict[str, Any] = field(default_factory=dict)
    prompt: EchoedPrompt = field(default_factory=EchoedPrompt)

    def add(self, response: generation_pb2.GenerateResponse) -> None:
        self.text.append(response.text)
        self.logprobs.extend(response.logprobs)
        self.prompt.add(response)
        self.pdserve.update(pdserve_json(response))
        self.last = response


class ResponseFormatter:
    """Builds the JSON of one request's answer: `chat` or text completion, whole or chunks."""

    def __init__(self, chat: bool, model: str, response_id: str, logprobs: bool, token_text: TokenText,
                 index: int = 0, tool_mode: ToolMode = ToolMode(), ignored_fields: tuple[str, ...] = (),
                 prompt_logprobs: bool = False) -> None:
        self._index = index  # the choice this formatter's chunks belong to
        self._ignored_fields = list(ignored_fields)  # said on the whole answer and the first chunk
        self._prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs parameter was given
        self._prompt = EchoedPrompt()  # completions with echo, streamed: what is known of it
        self._tool_mode = tool_mode
        self._holding = tool_mode.mode == "auto"  # streamed text held back while it may be a tool call
        self._held: list[str] = []
        self._calls = CallStream() if tool_mode.mode == "required" else None  # constrained: streamed as it comes
        self._chat = chat
        self._model = model
        self._id = response_id
        self._logprobs = logprobs
        self._token_text = token_text
        self._created = int(time.time())
        self._text_offset = 0
        self._sent_role = False

    def whole(self, collected: Collected) -> dict[str, Any]:
        return self.whole_many([collected])

    def whole_many(self, choices: list[Collected], num_prompt_copies: int = 1) -> dict[str, Any]:
        """One answer of several choices (index = position); usage summed, each prompt once
        (every `num_prompt_copies` consecutive choices share one prompt)."""
        out = self._envelope("chat.completion" if self._chat else "text_completion",
                             [self._choice(c, i) for i, c in enumerate(choices)])
        lasts = [c.last for c in choices]
        out["usage"] = None if None in lasts else usage_json(sum_usage(lasts, num_prompt_copies))
        out["pdserve"] = choices[0].pdserve if len(choices) == 1 else [c.pdserve for c in choices]
        if self._ignored_fields:
            for extra in out["pdserve"] if isinstance(out["pdserve"], list) else [out["pdserve"]]:
                extra["ignored_fields"] = self._ignored_fields
        if self._prompt_logprobs and self._chat:  # vLLM: on the response for chat, per choice otherwise
            out["prompt_logprobs"] = vllm_prompt_logprobs(choices[0].prompt.logprobs, self._token_text)
        return out

    def _choice(self, collected: Collected, index: int) -> dict[str, Any]:
        last = collected.last
        text = collected.prompt.text + "".join(collected.text)
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason(last) if last else None,
                                  "logprobs": None}
        if self._logprobs:
            choice["logprobs"] = self._logprobs_json(collected.logprobs, collected.prompt, 0)
        if self._chat:
            choice["message"] = {"role": "assistant", "content": text}
            calls = tool_calls(text, self._tool_mode) if self._tool_mode.mode else None
            if calls:
                choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
                choice["finish_reason"] = self._tool_mode.call_finish_reason
        else:
            choice["text"] = text
            if self._prompt_logprobs:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(collected.prompt.logprobs, self._token_text)
        return choice

    def chunk(self, response: generation_pb2.GenerateResponse, include_usage: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self._index, "finish_reason": finish_reason(response), "logprobs": None}
        if self._chat:
            delta = self._delta(response, choice)
            if not self._sent_role:
                delta["role"], self._sent_role = "assistant", True
            choice["delta"] = delta
            if self._logprobs and response.logprobs:
                choice["logprobs"] = chat_logprobs(list(response.logprobs), self._token_text)
        else:
            choice["text"] = response.prompt_text + response.text
            self._prompt.add(response)
            if self._logprobs and (response.logprobs or response.prompt_logprobs):
                choice["logprobs"] = self._logprobs_json(list(response.logprobs), self._prompt, self._text_offset)
            self._text_offset += len(choice["text"])
        out = self._envelope("chat.completion.chunk" if self._chat else "text_completion", [choice])
        if self._prompt_logprobs and response.prompt_logprobs:  # the first message carries them all
            (out if self._chat else choice)["prompt_logprobs"] = vllm_prompt_logprobs(
                list(response.prompt_logprobs), self._token_text)
        if include_usage:
            out["usage"] = None
        out["pdserve"] = pdserve_json(response)
        if self._ignored_fields:
            out["pdserve"]["ignored_fields"], self._ignored_fields = self._ignored_fields, []
        return out

    def _logprobs_json(self, entries: list[common_pb2.TokenLogprob], prompt: EchoedPrompt,
                       text_offset: int) -> dict[str, Any]:
        if self._chat:
            return chat_logprobs(entries, self._token_text)
        if prompt.first_token_id is not None and not prompt.listed:
            return echoed_logprobs(prompt, entries, self._token_text)
        return completion_logprobs(entries, self._token_text, text_offset)

    def _delta(self, response: generation_pb2.GenerateResponse, choice: dict[str, Any]) -> dict[str, Any]:
        """A chat chunk's delta. A constrained call (tool_choice required or named) streams as
        tool_call deltas while it is written (tool_stream). Under "auto" the text is held back
        while it may be calls (until it starts with anything but a JSON object or list or a
        <tool_call> tag) and calls are sent whole, each with its index, when the answer ends."""
        if self._calls is not None:
            deltas = self._calls.feed(response.text)
            if response.finish_reason and self._calls.num_calls and choice["finish_reason"] == "stop":
                choice["finish_reason"] = self._tool_mode.call_finish_reason
            return {"tool_calls": deltas} if deltas else {}
        if not self._holding:
            return {"content": response.text}
        self._held.append(response.text)
        text = "".join(self._held)
        if text.strip() and not may_be_calls(text):
            self._holding, self._held = False, []  # plain text: streamed from here on
            return {"content": text}
        if not response.finish_reason:
            return {}
        calls = tool_calls(text, self._tool_mode)
        if not calls:
            return {"content": text}
        choice["finish_reason"] = self._tool_mode.call_finish_reason
        return {"tool_calls": stream_deltas(calls)}

    def usage_chunk(self, usage: common_pb2.Usage) -> dict[str, Any]:
        """The extra last chunk of stream_options.include_usage: no choices, the usage."""
        out = self._envelope("chat.completion.chunk" if self._chat else "text_completion", [])
        out["usage"] = usage_json(usage)
        return out

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self._id, "object": obj, "created": self._created, "model": self._model, "choices": choices}


def sum_usage(lasts: list[generation_pb2.GenerateResponse], num_prompt_copies: int) -> common_pb2.Usage:
    """Usage of several choices: completions summed, each prompt counted once."""
    total = common_pb2.Usage()
    for i, last in enumerate(lasts):
        total.completion_tokens += last.usage.completion_tokens
        total.accepted_draft_tokens += last.usage.accepted_draft_tokens
        total.rejected_draft_tokens += last.usage.rejected_draft_tokens
        total.draft_steps += last.usage.draft_steps
        if i % num_prompt_copies == 0:
            total.prompt_tokens += last.usage.prompt_tokens
            total.cached_prompt_tokens += last.usage.cached_prompt_tokens
    return total


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n".encode("utf-8")

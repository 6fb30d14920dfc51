"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

The client asks for `stream: true` with `stream_options.include_usage`, reads the SSE
lines as they arrive, stamps each chunk that carries output text, and takes the token
counts from the final usage chunk (falling back to the number of text chunks when the
server sends no usage). A request that fails (HTTP status, error event, broken stream,
deadline) becomes a failed RequestResult; it never raises into the load generator.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, Sequence

from pdserve.bench.report import RequestResult
from pdserve.bench.workload import BenchConfigError, BenchRequest, Message

ENDPOINTS = {"chat": "/chat/completions", "completions": "/completions"}


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where and how to send: `base_url` ends in /v1; `model` None means ask /models."""

    base_url: str
    model: str | None = None
    api_key: str | None = None
    kind: str = "chat"  # "chat" | "completions"
    temperature: float = 0.0
    extra_body_json: str = "{}"  # merged into every request body (e.g. {"ignore_eos": true})
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.kind not in ENDPOINTS:
            raise BenchConfigError(f"endpoint {self.kind!r}: expected one of {sorted(ENDPOINTS)}")
        if not self.base_url.startswith(("http://", "https://")):
            raise BenchConfigError(f"base url {self.base_url!r}: expected http(s)://host:port/v1")
        if not self.request_timeout_s > 0:
            raise BenchConfigError("request timeout must be > 0")
        try:
            extra = json.loads(self.extra_body_json)
        except json.JSONDecodeError as e:
            raise BenchConfigError(f"extra body: not JSON ({e.msg})") from None
        if not isinstance(extra, dict):
            raise BenchConfigError("extra body: expected a JSON object")


class _Trace:
    """What the stream has shown so far; survives a deadline that cuts the stream."""

    __slots__ = ("chunk_times", "prompt_tokens", "completion_tokens", "finish_reason", "done", "text",
                 "accepted", "rejected", "parts", "cached", "cached_by_tier", "token_ids")

    def __init__(self) -> None:
        self.chunk_times: list[float] = []
        self.text = hashlib.sha256()
        self.parts: list[str] = []  # the output text itself (a multi-turn session sends it back)
        self.token_ids: list[int] = []  # the output's ids, when asked for (return_tokens_as_token_ids)
        self.cached: int | None = None
        self.cached_by_tier: tuple[tuple[str, int], ...] = ()
        self.accepted: int | None = None
        self.rejected: int | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.finish_reason = ""
        self.done = False


class StreamError(Exception):
    """The server answered, but not with a usable stream."""


class OpenAIStreamClient:
    """Sends BenchRequests over one pooled httpx.AsyncClient. Use as an async context."""

    def __init__(self, endpoint: Endpoint, max_connections: int = 1024) -> None:
        import httpx

        self.endpoint = endpoint
        self.model = endpoint.model
        self._extra = json.loads(endpoint.extra_body_json)
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        self._url = endpoint.base_url.rstrip("/") + ENDPOINTS[endpoint.kind]
        # trust_env=False: no proxy from the environment between the bench and the server.
        self._http = httpx.AsyncClient(
            headers=headers, trust_env=False,
            timeout=httpx.Timeout(endpoint.request_timeout_s,
                                  connect=min(10.0, endpoint.request_timeout_s)),
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections))

    async def __aenter__(self) -> "OpenAIStreamClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self._http.aclose()

    async def ensure_model(self) -> str:
        """The model to name in requests: the configured one, else the first of /models."""
        if self.model is None:
            url = self.endpoint.base_url.rstrip("/") + "/models"
            try:
                resp = await asyncio.wait_for(self._http.get(url), self.endpoint.request_timeout_s)
                resp.raise_for_status()
                self.model = str(resp.json()["data"][0]["id"])
            except Exception as e:  # any failure here means: tell the user to pass --model
                raise BenchConfigError(f"could not list models at {url} ({_describe(e)}); "
                                    "pass --model") from None
        return self.model

    def body(self, req: BenchRequest) -> dict[str, Any]:
        models = self.model.split(",")  # several (a base model and its LoRA adapters): in turn
        body: dict[str, Any] = {"model": models[req.index % len(models)], "max_tokens": req.max_tokens,
                                "temperature": self.endpoint.temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.endpoint.kind == "chat":
            body["messages"] = [{"role": m.role, "content": m.content} for m in req.messages]
        else:
            body["prompt"] = req.prompt_text()
        body.update(self._extra)
        return body

    async def send(self, req: BenchRequest, run_start: float) -> RequestResult:
        """Send `req` now and time it; `run_start` is the perf_counter() origin of start_s."""
        return (await self.send_for_text(req, run_start))[0]

    async def send_for_text(self, req: BenchRequest, run_start: float,
                            user: str = "") -> tuple[RequestResult, str]:
        """`send`, also returning the output text; `user`: the request's `user` field (a session id)."""
        result, text, _ = await self.send_for_answer(req, run_start, user)
        return result, text

    async def send_for_answer(self, req: BenchRequest, run_start: float, user: str = "",
                              token_ids: bool = False) -> tuple[RequestResult, str, list[int] | None]:
        """`send_for_text`, also returning the output's token ids when `token_ids` (asked for as
        vLLM does: logprobs with return_tokens_as_token_ids); None where the server sent none
        for some token."""
        trace = _Trace()
        sent = time.perf_counter()
        error = ""
        body = self.body(req)
        if user:
            body["user"] = user
        if token_ids and self.endpoint.kind == "chat":
            body.update(logprobs=True, return_tokens_as_token_ids=True)
        try:
            await asyncio.wait_for(self._stream(body, trace), self.endpoint.request_timeout_s)
            if not trace.chunk_times:
                error = "no output text in the stream"
        except asyncio.TimeoutError:
            error = f"timeout after {self.endpoint.request_timeout_s:g} s"
        except StreamError as e:
            error = str(e)
        except Exception as e:  # transport errors of any kind are this request's failure
            error = _describe(e)
        ended = time.perf_counter()
        result = _result(req, trace, sent - run_start, sent, ended, error)
        ids = trace.token_ids if token_ids and len(trace.token_ids) == result.output_tokens else None
        return result, "".join(trace.parts), ids

    async def tokenize_chat(self, messages: Sequence[Message]) -> list[int] | None:
        """The prompt ids of a chat as the server builds them (its /tokenize, vLLM's shape, at the
        root beside /v1); None when the server has no such endpoint or fails."""
        root = self.endpoint.base_url.rstrip("/").removesuffix("/v1")
        body = {"model": self.model, "messages": [{"role": m.role, "content": m.content} for m in messages]}
        try:
            resp = await asyncio.wait_for(self._http.post(root + "/tokenize", json=body),
                                          self.endpoint.request_timeout_s)
            ids = resp.json().get("tokens") if resp.status_code == 200 else None
        except Exception:  # any failure: the ids are unknown, the caller judges without them
            return None
        return ids if isinstance(ids, list) and all(_int_or_none(i) is not None for i in ids) else None

    async def _stream(self, body: dict[str, Any], trace: _Trace) -> None:
        async with self._http.stream("POST", self._url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread())[:300].decode("utf-8", "replace")
                raise StreamError(f"HTTP {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    trace.done = True
                    return
                self._take_chunk(data, trace, time.perf_counter())
        if not trace.done:
            raise StreamError("stream ended without [DONE]")

    def _take_chunk(self, data: str, trace: _Trace, now: float) -> None:
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            raise StreamError(f"bad SSE data: {data[:100]!r}") from None
        if not isinstance(chunk, dict):
            raise StreamError(f"bad SSE data: {data[:100]!r}")
        if "error" in chunk:
            err = chunk["error"]
            raise StreamError(f"error event: {err.get('message', err) if isinstance(err, dict) else err}")
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            trace.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
            trace.completion_tokens = _int_or_none(usage.get("completion_tokens"))
            details = usage.get("completion_tokens_details")
            if isinstance(details, dict):
                trace.accepted = _int_or_none(details.get("accepted_prediction_tokens"))
                trace.rejected = _int_or_none(details.get("rejected_prediction_tokens"))
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                trace.cached = _int_or_none(details.get("cached_tokens"))
        extra = chunk.get("pdserve")  # pdserve's own object: the cached tokens by tier, for an admin key
        if isinstance(extra, dict) and isinstance(extra.get("cached_tokens_by_tier"), dict):
            trace.cached_by_tier = tuple(sorted((str(t), n) for t, n in extra["cached_tokens_by_tier"].items()
                                                if _int_or_none(n) is not None))
        for choice in chunk.get("choices") or ():
            if self.endpoint.kind == "chat":
                text = (choice.get("delta") or {}).get("content")
            else:
                text = choice.get("text")
            _take_token_ids(choice.get("logprobs"), trace)
            if text:
                trace.chunk_times.append(now)
                trace.text.update(str(text).encode())
                trace.parts.append(str(text))
            if choice.get("finish_reason"):
                trace.finish_reason = str(choice["finish_reason"])


def _result(req: BenchRequest, trace: _Trace, start_s: float, sent: float, ended: float,
            error: str) -> RequestResult:
    times = trace.chunk_times
    usage_reported = trace.completion_tokens is not None
    output_tokens = trace.completion_tokens if usage_reported else len(times)
    return RequestResult(
        index=req.index, class_name=req.class_name, success=not error, error=error,
        start_s=start_s, ttft_s=(times[0] - sent) if times else None, e2e_s=ended - sent,
        itl_s=tuple(b - a for a, b in zip(times, times[1:])), output_tokens=output_tokens,
        prompt_tokens=trace.prompt_tokens, usage_reported=usage_reported,
        num_chunks=len(times), finish_reason=trace.finish_reason,
        target_input_tokens=req.target_input_tokens, max_tokens=req.max_tokens,
        text_sha256=trace.text.hexdigest(), accepted_prediction_tokens=trace.accepted,
        rejected_prediction_tokens=trace.rejected, cached_tokens=trace.cached,
        cached_tokens_by_tier=trace.cached_by_tier)


def _take_token_ids(logprobs: object, trace: _Trace) -> None:
    """The ids of a chat chunk's logprobs entries written "token_id:N"."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    for entry in content or ():
        token = entry.get("token") if isinstance(entry, dict) else None
        if isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit():
            trace.token_ids.append(int(token[9:]))


def _int_or_none(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _describe(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__

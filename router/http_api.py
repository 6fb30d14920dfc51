"""HTTP edge of the router (FastAPI): OpenAI completions and chat, models, /tokenize and
/detokenize, health, metrics.

Handlers read the body under the size limit, parse it (`openai_request`), run the request
through the Frontend, and format the answer (`openai_format`). Errors become OpenAI error
JSON with the status of `pdserve.common.errors`. A client that goes away mid-request has its
request aborted on the decode worker (the stream is closed, which aborts it).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Send
from starlette.types import Scope as AsgiScope

from pdserve.common.errors import (EXPECTED_ERRORS, ErrorKind, InvalidRequestError, PayloadTooLargeError,
                                   ServiceError, UnauthenticatedError, to_service_error)
from pdserve.proto.pdserve.v1 import generation_pb2
from pdserve.router import fanout, tokenize_api
from pdserve.router.adapters import AdapterAdmin, AdapterDirectory
from pdserve.router.api_key import check_metrics_bearer
from pdserve.router.catalog import ModelCatalog
from pdserve.router.config import Role, RouterConfig
from pdserve.router.frontend import Frontend
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai_format import Collected, ResponseFormatter, TokenIds, sse
from pdserve.router.planner import can_carry
from pdserve.router.request_ids import new_request_id
from pdserve.router.openai_request import IgnoredFieldLog, OpenAIRequest, parse_chat, parse_completion
from pdserve.router.worker_registry import WorkerRegistry
from pdserve.security.client_keys import Caller, ClientKeys, Scope

log = logging.getLogger("pdserve.router.http")

BODY_READ_TIMEOUT_S = 60.0  # a client that stalls mid-body is dropped


def error_response(err: BaseException) -> JSONResponse:
    service_error = to_service_error(err)
    if service_error.kind is ErrorKind.INTERNAL:
        log.error("internal error: %s", service_error.message)
    return JSONResponse(service_error.openai_body(), status_code=service_error.http_status,
                        headers=service_error.http_headers())


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object; 413 over `max_bytes` (by Content-Length and while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise InvalidRequestError("bad Content-Length header")
        if int(declared) > max_bytes:
            raise PayloadTooLargeError(f"request body over {max_bytes} bytes")
    chunks: list[bytes] = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise PayloadTooLargeError(f"request body over {max_bytes} bytes")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), BODY_READ_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise InvalidRequestError(f"request body not received within {BODY_READ_TIMEOUT_S:g} s") from None
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise InvalidRequestError("the JSON body is nested too deeply") from None
    try:  # JSON may spell a lone surrogate ("\\ud800"), which no text can hold
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError("the JSON body holds a lone UTF-16 surrogate "
                                  "(e.g. \\ud800), which is not text") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    return body


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (call once the body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class DisconnectAwareStream(StreamingResponse):
    """A streaming response whose body iterator is closed as soon as the client goes away,
    whatever the ASGI server's spec version (closing it aborts the request)."""

    async def __call__(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait((streaming, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watching):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await streaming
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
        if not streaming.cancelled() and streaming.exception() is not None:
            raise streaming.exception()


class OpenAIHandlers:
    def __init__(self, frontend: Frontend, catalog: ModelCatalog, config: RouterConfig, auth: ClientKeys,
                 adapters: AdapterDirectory | None = None) -> None:
        self._frontend = frontend
        self._catalog = catalog
        self._adapters = adapters or AdapterDirectory(None)
        self._max_body_bytes = config.max_body_bytes
        self._auth = auth
        self._ignored = IgnoredFieldLog()

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def tokenize(self, request: Request) -> Response:
        return await self._tokenizer_call(request, tokenize_api.tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await self._tokenizer_call(request, tokenize_api.detokenize)

    async def _tokenizer_call(self, request: Request, call) -> Response:
        try:
            self._auth.check(request.headers.get("authorization"))
            body = await read_json_object(request, self._max_body_bytes)
            adapter = self._adapters.find(body["model"]) if isinstance(body.get("model"), str) else None
            if adapter is not None and not self._catalog.knows(adapter.name):
                body = {**body, "model": adapter.model_name}  # a LoRA adapter tokenizes as its base model
            return JSONResponse(await self._frontend.run_cpu(call, self._catalog, body))  # off the event loop
        except EXPECTED_ERRORS as err:
            return error_response(err)

    async def models(self, request: Request) -> Response:
        try:
            self._auth.check(request.headers.get("authorization"))
        except EXPECTED_ERRORS as err:
            return error_response(err)
        models = {m.name: m for m in self._catalog.models()}
        data = [{"id": m.name, "object": "model", "created": m.created_unix, "owned_by": "pdserve",
                 "root": m.name, "parent": None, "max_model_len": m.max_model_len} for m in models.values()]
        for adapter in self._adapters.served():  # vLLM's shape: an adapter's parent is its base model
            base = models.get(adapter.model_name)
            if base is not None and adapter.name not in models:
                data.append({"id": adapter.name, "object": "model", "created": base.created_unix,
                             "owned_by": "pdserve", "root": adapter.name, "parent": adapter.parent,
                             "max_model_len": base.max_model_len})
        return JSONResponse({"object": "list", "data": data})

    async def _handle(self, request: Request, chat: bool) -> Response:
        api = "http_chat" if chat else "http_completions"
        try:
            caller = self._auth.identify(request.headers.get("authorization"))
            body = await read_json_object(request, self._max_body_bytes)
            parsed = parse_chat(body) if chat else parse_completion(body)
        except EXPECTED_ERRORS as err:
            self._frontend.count_rejected(api, err)
            return error_response(err)
        self._ignored.note(parsed.ignored_fields, request.url.path)
        prefix = "chatcmpl" if chat else "cmpl"
        parsed.request.request_id = new_request_id(prefix)  # the router's: no client names an HTTP request
        if parsed.best_of > 1 or len(parsed.prompts) > 1:
            return await self._fan_out(request, parsed, chat, api, caller)
        responses = self._frontend.generate(parsed.request, api=api, request_id=parsed.request.request_id,
                                            scope=caller.scope, tenant=caller.tenant)
        formatter = ResponseFormatter(chat, parsed.model, parsed.request.request_id, parsed.request.sampling.logprobs,
                                      self._token_text(parsed), tool_mode=parsed.tool_mode,
                                      ignored_fields=parsed.ignored_fields, prompt_logprobs=parsed.prompt_logprobs)
        if parsed.stream:
            return await self._stream(request, responses, formatter, parsed)
        return await _until_disconnect(request.receive, self._collect(responses, formatter))

    async def _collect(self, responses: AsyncIterator[generation_pb2.GenerateResponse],
                       formatter: ResponseFormatter) -> Response:
        collected = Collected()
        try:
            async with contextlib.aclosing(responses):
                async for response in responses:
                    collected.add(response)
        except EXPECTED_ERRORS as err:
            return error_response(err)
        return JSONResponse(formatter.whole(collected))

    async def _stream(self, request: Request, responses: AsyncIterator[generation_pb2.GenerateResponse],
                      formatter: ResponseFormatter, parsed: OpenAIRequest) -> Response:
        return await _answer_stream(request.receive, responses, lambda first: _sse_events(
            first, responses, formatter, parsed.include_usage))

    async def _fan_out(self, request: Request, parsed: OpenAIRequest, chat: bool, api: str,
                       caller: Caller) -> Response:
        """Several choices (n, best_of, prompt lists): see `fanout`."""
        rid = parsed.request.request_id
        choices = fanout.plan_choices(parsed, rid)

        def generate(one: generation_pb2.GenerateRequest):
            return self._frontend.generate(one, api=api, request_id=one.request_id, scope=caller.scope,
                                           tenant=caller.tenant)

        def formatter(index: int) -> ResponseFormatter:
            return ResponseFormatter(chat, parsed.model, rid, parsed.request.sampling.logprobs,
                                     self._token_text(parsed), index, parsed.tool_mode,
                                     parsed.ignored_fields, parsed.prompt_logprobs)

        if parsed.stream:
            stream = fanout.merged(choices, generate)
            return await _answer_stream(request.receive, stream, lambda first: fanout.sse_events(
                parsed, len(choices), first, stream, formatter))

        async def answer() -> Response:
            try:
                return JSONResponse(await fanout.whole(parsed, choices, generate, formatter(0)))
            except EXPECTED_ERRORS as err:
                return error_response(err)
        return await _until_disconnect(request.receive, answer())

    def _token_text(self, parsed: OpenAIRequest) -> Callable[[int], str]:
        if parsed.tokens_as_ids:
            return TokenIds()
        model_name = parsed.model

        def token_text(token_id: int) -> str:
            return self._frontend.resolve(model_name)[0].prompts.token_text(token_id)
        return token_text


async def _sse_events(first: generation_pb2.GenerateResponse, responses: AsyncIterator[generation_pb2.GenerateResponse],
                      formatter: ResponseFormatter, include_usage: bool) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(responses):
        try:
            response = first
            while response is not None:
                yield sse(formatter.chunk(response, include_usage))
                if include_usage and response.HasField("usage") and response.finish_reason:
                    yield sse(formatter.usage_chunk(response.usage))
                response = await anext(responses, None)
        except EXPECTED_ERRORS as err:  # mid-stream: the status is already sent; say it in the stream
            yield sse(to_service_error(err).openai_body())
    yield sse("[DONE]")


_CLIENT_GONE = ServiceError(ErrorKind.CANCELLED, "client disconnected")

# A streamed request waits up to FIRST_MESSAGE_HOLD_S for its first message before it
# answers, so that an error before it gets a real status. A first message slower than that
# (a queue, a prompt recomputed after a failed leg) commits the answer to 200: an SSE comment
# goes out every KEEPALIVE_S until the first message, so no client's or proxy's read timeout
# cuts a request that is still on its way, and an error after that is an SSE error event.
FIRST_MESSAGE_HOLD_S = 10.0
KEEPALIVE_S = 5.0
_KEEPALIVE_COMMENT = b": waiting for the first token\n\n"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _answer_stream(receive: Receive, stream: AsyncIterator[Any],
                         events: Callable[[Any], AsyncIterator[bytes]]) -> Response:
    """The response of a streamed request: `events(first)` is its SSE body from the first
    message of `stream` on."""
    pending = asyncio.ensure_future(anext(stream))
    watch = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((pending, watch), timeout=FIRST_MESSAGE_HOLD_S, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled: take the request down with it
        await _drop(pending, stream)
        raise
    finally:
        watch.cancel()
    if pending.done():
        try:
            first = pending.result()
        except EXPECTED_ERRORS as err:
            await stream.aclose()
            return error_response(err)
        except StopAsyncIteration:
            return error_response(ServiceError(ErrorKind.INTERNAL, "empty stream"))
        return DisconnectAwareStream(events(first), media_type="text/event-stream", headers=_SSE_HEADERS)
    if watch.done() and not watch.cancelled():  # the client left while waiting
        await _drop(pending, stream)
        return error_response(_CLIENT_GONE)
    return DisconnectAwareStream(_after_keepalives(pending, stream, events), media_type="text/event-stream",
                                 headers=_SSE_HEADERS)


async def _after_keepalives(pending: asyncio.Future, stream: AsyncIterator[Any],
                            events: Callable[[Any], AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """Keep-alive comments until `pending` (the first message) is done, then the events."""
    try:
        while not (await asyncio.wait((pending,), timeout=KEEPALIVE_S))[0]:
            yield _KEEPALIVE_COMMENT
        first = pending.result()
    except EXPECTED_ERRORS as err:
        yield sse(to_service_error(err).openai_body())
        yield sse("[DONE]")
        return
    except StopAsyncIteration:
        yield sse(ServiceError(ErrorKind.INTERNAL, "empty stream").openai_body())
        yield sse("[DONE]")
        return
    finally:
        if not pending.done():  # the client left: cancelling closes the stream, aborting it
            await _drop(pending, stream)
    async for chunk in events(first):
        yield chunk


async def _drop(pending: asyncio.Future, stream: AsyncIterator[Any]) -> None:
    pending.cancel()
    with contextlib.suppress(BaseException):
        await pending
    with contextlib.suppress(RuntimeError):
        await stream.aclose()


async def _until_disconnect(receive: Receive, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it if the client disconnects first (a Response then)."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((work_task, watch_task), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled: take the work down with it
        work_task.cancel()
        raise
    finally:
        watch_task.cancel()
    if work_task.done():
        return work_task.result()
    work_task.cancel()  # cancelling closes the request's stream, which aborts it on decode
    with contextlib.suppress(asyncio.CancelledError):
        await work_task
    return error_response(_CLIENT_GONE)


def build_http_app(frontend: Frontend, catalog: ModelCatalog, registry: WorkerRegistry, metrics: RouterMetrics,
                   config: RouterConfig, auth: ClientKeys, admin: AdapterAdmin | None = None) -> FastAPI:
    """`admin`: the LoRA administration; its endpoints exist only when it is enabled."""
    app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None, openapi_url=None)
    handlers = OpenAIHandlers(frontend, catalog, config, auth, AdapterDirectory(registry))
    app.add_api_route("/v1/completions", handlers.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", handlers.chat, methods=["POST"])
    app.add_api_route("/v1/models", handlers.models, methods=["GET"])
    app.add_api_route("/tokenize", handlers.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", handlers.detokenize, methods=["POST"])

    async def health(request: Request) -> Response:
        """Liveness: 200 while the process serves; the body says what is routable, as much
        as the caller's scope may see."""
        body = _health_body(registry, catalog, auth.scope(request.headers.get("authorization")))
        return JSONResponse(body)

    async def ready(request: Request) -> Response:
        """Readiness: 200 once a model is known and a decode worker is alive, else 503."""
        body = _health_body(registry, catalog, auth.scope(request.headers.get("authorization")))
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    async def prometheus(request: Request) -> Response:
        try:
            check_metrics_bearer(config, request.headers.get("authorization"))
        except EXPECTED_ERRORS as err:
            return error_response(err)
        return Response(metrics.render(registry), media_type=metrics.content_type)

    if admin is not None and admin.enabled:
        add_lora_routes(app, admin, auth, config.max_body_bytes)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ready", ready, methods=["GET"])
    app.add_api_route("/metrics", prometheus, methods=["GET"])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = ErrorKind.NOT_FOUND if exc.status_code == 404 else ErrorKind.INVALID_ARGUMENT
        body = ServiceError(kind, f"{request.method} {request.url.path}: {exc.detail}").openai_body()
        body["error"]["code"] = None
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(ServiceError(ErrorKind.INVALID_ARGUMENT, str(exc)))

    return app


def add_lora_routes(app: FastAPI, admin: AdapterAdmin, auth: ClientKeys, max_body_bytes: int) -> None:
    """vLLM's runtime adapter endpoints, for the admin key only (a client key is 401)."""

    def endpoint(action: Callable[[dict], Awaitable[dict]]):
        async def handle(request: Request) -> Response:
            try:
                if auth.check(request.headers.get("authorization")) < Scope.ADMIN:
                    raise UnauthenticatedError("LoRA adapter administration needs the admin key")
                body = await read_json_object(request, max_body_bytes)
                return JSONResponse(await action(body))
            except EXPECTED_ERRORS as err:
                return error_response(err)
        return handle

    app.add_api_route("/v1/load_lora_adapter", endpoint(admin.load), methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", endpoint(admin.unload), methods=["POST"])


def _health_body(registry: WorkerRegistry, catalog: ModelCatalog, scope: Scope) -> dict[str, Any]:
    """ANONYMOUS: the status; CLIENT: models and worker counts too; ADMIN: each worker's KV
    backends by worker id, and whether remote prefill is degraded."""
    num_decode = len([r for r in registry.alive(Role.DECODE) if not r.suspect])
    num_prefill = len([r for r in registry.alive(Role.PREFILL) if not r.suspect])
    ready = bool(num_decode and catalog.names())
    backends = {r.worker_id: {b.name: "ok" if b.usable else f"unusable: {b.detail}" for b in r.load.kv_backends}
                for r in registry.alive() if r.load.kv_backends}
    decoders = registry.alive(Role.DECODE)
    # remote prefill is degraded when some live prefill shares no usable backend with some decode
    degraded = any(not can_carry(p, d) for p in registry.alive(Role.PREFILL) for d in decoders
                   if p.worker.model_name == d.worker.model_name)
    body: dict[str, Any] = {"status": "ok" if ready else "no_workers"}
    if scope >= Scope.CLIENT:
        body.update(models=catalog.names(), decode_workers=num_decode, prefill_workers=num_prefill)
    if scope >= Scope.ADMIN:
        body.update(kv_transfer="degraded" if degraded else "ok", kv_backends=backends)
        body["lora_adapters"] = {r.worker_id: {a.name: "loaded" if a.loaded else "loadable" for a in r.load.lora_adapters}
                                 for r in registry.alive() if r.load.lora_adapters}
    return body

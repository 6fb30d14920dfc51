"""What every pdserve gRPC server adds: standard health checking, reflection, message size
limits, and (internal servers) a cap on calls in flight.

    server = internal_server(WORKER_MAX_RECEIVE_BYTES, interceptors)
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, [service_name(decode_pb2, "Decode")])
    server.add_insecure_port("127.0.0.1:50070"); await server.start()
    await set_serving(health, [service_name(decode_pb2, "Decode")])

Before a caller is verified a server spends little: the credential interceptor (the API key's,
on the router's client port) refuses a call without reading its message (`refuse_unread`), a
message over the server's receive limit is refused by grpc as its length arrives, and at most
MAX_CONCURRENT_RPCS calls run at once (more get RESOURCE_EXHAUSTED). The receive limits
follow the largest real message of each service, measured: a DecodeRequest of a
131,072-token prompt with 32,768 resumed tokens and its block hashes is 0.55 MB; its sampling
part comes from a client body of at most the router's --max-body-bytes (4 MiB by default); a
PrefillRequest is smaller (no resumed tokens, a hand-off of one id per block); registry calls
carry a worker's description and load report, a few KB. KV never travels over gRPC (the
transfer backends carry it).
"""
from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any, Callable, Iterable, Sequence

import grpc

from pdserve.rpc.errors import abort_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # what a channel takes in (a ModelInfo's tokenizer.json)
WORKER_MAX_RECEIVE_BYTES = 16 * 1024 * 1024  # Decode and Prefill requests, with room to spare
REGISTRY_MAX_RECEIVE_BYTES = 1024 * 1024  # Register / Heartbeat / Deregister
MAX_CONCURRENT_RPCS = 1024  # per internal server: well above a decode's streams in flight
NO_PORT_SHARING = (("grpc.so_reuseport", 0),)  # a second listener on a used port fails to bind
# Servers take the channels' pings (below), also on a connection with no call, at most one a
# second: more often, grpc's default answers with GOAWAY "too_many_pings".
PERMIT_KEEPALIVE = (("grpc.keepalive_permit_without_calls", 1),
                    ("grpc.http2.min_ping_interval_without_data_ms", 1_000))


def server_options(max_receive_bytes: int) -> tuple[tuple[str, int], ...]:
    """A pdserve server's gRPC options (internal servers and the router's client port).
    HTTP/2 flow-control windows stay at their initial size (no bandwidth-delay probing):
    probing grew them while anonymous calls were still sending, so a refused call's bytes
    arrived anyway. Messages are small (a 131,072-token DecodeRequest is 0.55 MB; a client's
    is at most the router's --max-body-bytes; KV never goes over gRPC)."""
    return (("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.http2.bdp_probe", 0)) + NO_PORT_SHARING + PERMIT_KEEPALIVE


SERVER_OPTIONS = server_options(WORKER_MAX_RECEIVE_BYTES)
# A peer cut off by a partition sends nothing, not even a reset: only a ping finds it. Every
# internal channel pings after KEEPALIVE_TIME_MS without a byte from its peer, idle or not,
# and closes its connection when the answer takes longer than KEEPALIVE_TIMEOUT_MS (grpc
# enforces it as the ping timeout); its calls then end UNAVAILABLE, so a call waiting on an
# unreachable peer ends within the sum of the two, not at its deadline.
KEEPALIVE_TIME_MS = 4_000
KEEPALIVE_TIMEOUT_MS = 4_000
CHANNEL_OPTIONS = (("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.enable_retries", 0),  # callers decide about retries
                   ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
                   ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                   ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                   ("grpc.keepalive_permit_without_calls", 1),
                   ("grpc.http2.max_pings_without_data", 0),  # a long Prefill call is silent
                   # a peer back from a partition is reconnected to within a second, whatever
                   # the number of failed attempts before (grpc's default grows to 2 minutes)
                   ("grpc.max_reconnect_backoff_ms", 1_000))


def internal_server(max_receive_bytes: int, interceptors: Sequence[Any] = ()) -> grpc.aio.Server:
    """A grpc.aio server for internal services: `interceptors` (the credential check first),
    then malformed-request refusal; messages up to `max_receive_bytes`; at most
    MAX_CONCURRENT_RPCS calls at once (options: `server_options`)."""
    return grpc.aio.server(options=server_options(max_receive_bytes),
                           interceptors=[*interceptors, MalformedRequestInterceptor()],
                           maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)


def refuse_unread(handler: grpc.RpcMethodHandler | None, err: BaseException,
                  on_refuse: Callable[[Any], None] = lambda context: None) -> grpc.RpcMethodHandler | None:
    """A handler for an interceptor that refuses a call before reading it: it ends the call
    with `err`'s status from the error table and never receives the request. It takes the
    request as a stream it does not read; a unary handler would have grpc receive the whole
    message (up to the receive limit) first. `on_refuse(context)` runs first (to log the
    peer). An unknown method (None) stays None: grpc answers UNIMPLEMENTED."""
    if handler is None:
        return None

    async def refuse_unary(requests, context):
        on_refuse(context)
        await abort_grpc(context, err)

    async def refuse_stream(requests, context):
        on_refuse(context)
        await abort_grpc(context, err)
        yield  # pragma: no cover - makes this an async generator

    ignore = lambda data: None  # noqa: E731 - the request of a refused call is never parsed
    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, request_deserializer=ignore,
                                                     response_serializer=handler.response_serializer)
    return grpc.stream_unary_rpc_method_handler(refuse_unary, request_deserializer=ignore,
                                                response_serializer=handler.response_serializer)


def service_name(pb2_module: ModuleType, service: str) -> str:
    """Full name of a service of a generated module, e.g. "pdserve.v1.Decode"."""
    return pb2_module.DESCRIPTOR.services_by_name[service].full_name


def add_health_and_reflection(server: Any, service_names: Iterable[str]) -> Any:
    """Add grpc.health.v1.Health and server reflection to a grpc.aio server (before start);
    returns the health servicer (NOT_SERVING until `set_serving`)."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    return servicer


async def set_serving(health_servicer: Any, service_names: Iterable[str], serving: bool = True) -> None:
    """Mark the server ("") and each service SERVING (or NOT_SERVING, e.g. while draining)."""
    from grpc_health.v1 import health_pb2

    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *service_names):
        await health_servicer.set(name, status)


class _Malformed:
    """Stands for a request whose bytes did not parse."""


_MALFORMED = _Malformed()


def _tolerant(deserializer):
    def parse(data: bytes):
        try:
            return deserializer(data) if deserializer is not None else data
        except Exception:  # noqa: BLE001 - protobuf's DecodeError, bad UTF-8 in a string field
            return _MALFORMED
    return parse


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """A request that is not a valid protobuf of its method's type (garbage bytes, a string
    field that is not UTF-8) ends with INVALID_ARGUMENT and a fixed message, before any
    servicer code runs, instead of grpc's UNKNOWN carrying a Python exception's text."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler

        async def refuse(context):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed request: not a valid protobuf message")

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request, context):
                if request is _MALFORMED:
                    await refuse(context)
                return await inner(request, context)
            return grpc.unary_unary_rpc_method_handler(unary, _tolerant(handler.request_deserializer),
                                                       handler.response_serializer)
        inner_stream = handler.unary_stream
        if not inspect.isasyncgenfunction(inner_stream):  # it writes with context.write (health's Watch)
            async def writer(request, context):
                if request is _MALFORMED:
                    await refuse(context)
                await inner_stream(request, context)
            return grpc.unary_stream_rpc_method_handler(writer, _tolerant(handler.request_deserializer),
                                                        handler.response_serializer)

        async def stream(request, context):
            if request is _MALFORMED:
                await refuse(context)
            async for item in inner_stream(request, context):
                yield item
        return grpc.unary_stream_rpc_method_handler(stream, _tolerant(handler.request_deserializer),
                                                    handler.response_serializer)

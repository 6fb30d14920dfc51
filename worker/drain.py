"""A worker leaving without losing work: the drain that runs between SIGTERM and the stop.

1. The worker reports `draining` in its load and sends that report to every router at once;
   a router that has it routes nothing new here (`WorkerRegistry.routable`).
2. It keeps serving what it has: open Decode streams and Prefill calls (counted by
   `OpenCalls` at the gRPC edge) and its engine's requests, until none is left and none has
   arrived for `QUIET_S` (a request a router sent just before it read the report is still
   on its way), or until `--drain-timeout-s` passes.
3. Then the usual stop: deregister, stop the server. A decode stream still open then is cut
   and the router migrates it (prompt plus the tokens already streamed, to another decode);
   a prefill still running ends with its decode's failure policy. Either way the client's
   request goes on. The drain deadline stays under the 10 s in which every process stops
   after SIGTERM.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc

log = logging.getLogger("pdserve.worker.drain")

QUIET_S = 0.5
ANNOUNCE_TIMEOUT_S = 2.0
WORK_METHODS = ("/pdserve.v1.Decode/Decode", "/pdserve.v1.Prefill/Prefill")


class DrainState:
    """Whether this worker is draining: read by every load report."""

    def __init__(self) -> None:
        self.draining = False


class OpenCalls(grpc.aio.ServerInterceptor):
    """Counts the work calls (Decode streams, Prefill calls) this server is serving now, and
    remembers when the last one arrived."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.num_open = 0
        self.last_arrival = float("-inf")
        self._clock = clock

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in WORK_METHODS:
            return handler
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(self._stream(handler.unary_stream),
                                                        handler.request_deserializer, handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary),
                                                       handler.request_deserializer, handler.response_serializer)
        return handler

    def _enter(self) -> None:
        self.num_open += 1
        self.last_arrival = self._clock()

    def _stream(self, behaviour):
        async def counted(request, context):
            self._enter()
            try:
                async for response in behaviour(request, context):
                    yield response
            finally:
                self.num_open -= 1
        return counted

    def _unary(self, behaviour):
        async def counted(request, context):
            self._enter()
            try:
                return await behaviour(request, context)
            finally:
                self.num_open -= 1
        return counted


async def drain(state: DrainState, announce, calls: OpenCalls, engine_busy: Callable[[], bool],
                timeout_s: float, clock: Callable[[], float] = time.monotonic) -> bool:
    """Steps 1 and 2 above. `announce()`: send the draining report to every router (awaited
    for at most ANNOUNCE_TIMEOUT_S); `engine_busy()`: whether the engine still holds requests.
    True when everything finished within `timeout_s`; False when the deadline ended it."""
    started = clock()
    state.draining = True
    log.info("draining: no new work; waiting up to %.0f s for what is in flight", timeout_s)
    try:
        await asyncio.wait_for(announce(), min(ANNOUNCE_TIMEOUT_S, timeout_s))
    except (asyncio.TimeoutError, OSError, grpc.aio.AioRpcError) as err:
        log.warning("draining: not every router acknowledged (%r); waiting anyway", err)
    while clock() - started < timeout_s:
        quiet = clock() - max(calls.last_arrival, started) >= QUIET_S
        if calls.num_open == 0 and not engine_busy() and quiet:
            log.info("drained in %.1f s", clock() - started)
            return True
        await asyncio.sleep(0.05)
    log.warning("drain deadline (%.0f s) passed with %d calls open: they end now (a decode stream migrates)",
                timeout_s, calls.num_open)
    return False

"""Calls to decode workers: the Decode stream, and Abort when a stream is left early.

A stream left before its last message (client gone, cancelled call, error) is cancelled
and, explicitly, aborted on the worker (`Decode.Abort`), so the worker frees the request's
blocks even if the cancellation is lost. A worker that cannot be reached is marked suspect.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Coroutine

import grpc

from pdserve.common.errors import ErrorKind, ServiceError, to_service_error
from pdserve.proto.pdserve.v1 import common_pb2, decode_pb2
from pdserve.router.channels import WorkerChannels
from pdserve.router.registry import Worker, WorkerRegistry

log = logging.getLogger("pdserve.router.dispatch")

# Status codes that say the worker itself is unreachable, not that the request failed.
_STREAM_FAILURE_CODES = (grpc.StatusCode.UNAVAILABLE,)
_UNARY_FAILURE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# TransferVerdict.prefill_status_code values that make the prefill worker suspect.
_PREFILL_FAILURE_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")


async def read_within(call: grpc.aio.UnaryStreamCall, timeout_s: float) -> Any:
    """`call.read()` with a deadline. Not `asyncio.wait_for`: before Python 3.12 it can
    swallow a cancellation that races with the read completing, and a cancelled request
    (client gone) must always reach the `finally` that aborts it."""
    if hasattr(asyncio, "timeout"):  # Python >= 3.11
        async with asyncio.timeout(timeout_s):
            return await call.read()
    return await asyncio.wait_for(call.read(), timeout_s)  # pragma: no cover - Python 3.10


class BackgroundTasks:
    """Fire-and-forget coroutines that must not be garbage-collected mid-flight."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout_s: float) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)


class DecodeClient:
    def __init__(self, channels: WorkerChannels, registry: WorkerRegistry, tasks: BackgroundTasks,
                 idle_timeout_s: float, rpc_timeout_s: float) -> None:
        self._channels = channels
        self._registry = registry
        self._tasks = tasks
        self._idle_timeout_s = idle_timeout_s
        self._rpc_timeout_s = rpc_timeout_s

    async def stream(self, worker: Worker, request: decode_pb2.DecodeRequest) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """The worker's Decode stream, message by message, ending after the message with a
        finish_reason. Errors are ServiceErrors (the worker's status mapped back)."""
        call = self._channels.decode(worker.address).Decode(request)
        finished = False  # the last message arrived
        ended_by_worker = False  # the worker closed the call (error status or early EOF)
        try:
            while not finished:
                try:
                    message = await read_within(call, self._idle_timeout_s)
                except asyncio.TimeoutError:
                    raise ServiceError(ErrorKind.DEADLINE_EXCEEDED, f"decode worker {worker.worker_id} sent "
                                       f"nothing for {self._idle_timeout_s:g} s") from None
                except grpc.aio.AioRpcError as err:
                    ended_by_worker = True
                    self._note_failure(worker, err, _STREAM_FAILURE_CODES)
                    raise to_service_error(err) from None
                if message is grpc.aio.EOF:
                    ended_by_worker = True
                    raise ServiceError(ErrorKind.UNAVAILABLE,
                                       f"decode worker {worker.worker_id} ended the stream without finishing")
                finished = message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                if message.HasField("transfer"):
                    self._note_prefill_verdict(message.transfer)
                yield message
        finally:
            if not finished and not ended_by_worker:
                # Left early (consumer gone, cancelled, idle timeout): cancel the call and,
                # in case the cancellation is lost, abort the request explicitly.
                call.cancel()
                self._tasks.spawn(self.abort(worker, request.request_id, "router_stream_closed"))

    async def abort(self, worker: Worker, request_id: str, reason: str) -> bool:
        """Decode.Abort with a deadline; False when the worker did not know the request or
        could not be reached (logged)."""
        stub = self._channels.decode(worker.address)
        try:
            response = await stub.Abort(common_pb2.AbortRequest(request_id=request_id, reason=reason),
                                        timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as err:
            self._note_failure(worker, err, _UNARY_FAILURE_CODES)
            log.warning("abort %s on %s failed: %s %s", request_id, worker.worker_id, err.code().name, err.details())
            return False
        log.info("aborted %s on %s (%s): found=%s", request_id, worker.worker_id, reason, response.found)
        return response.found

    def _note_prefill_verdict(self, verdict: common_pb2.TransferVerdict) -> None:
        """Decode reports a prefill worker it could not reach: stop routing to it."""
        if verdict.prefill_worker_id and verdict.prefill_status_code in _PREFILL_FAILURE_CODES:
            self._registry.mark_suspect(verdict.prefill_worker_id,
                                        f"decode reported {verdict.prefill_status_code}: {verdict.reason}")

    def _note_failure(self, worker: Worker, err: grpc.aio.AioRpcError, codes: tuple) -> None:
        if err.code() in codes:
            self._registry.mark_suspect(worker.worker_id, f"{err.code().name}: {err.details()}")

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
from pdserve.rpc.channels import WorkerChannels
from pdserve.router.worker_registry import Worker, WorkerRegistry

log = logging.getLogger("pdserve.router.dispatch")

# Status codes that say the worker itself is unreachable, not that the request failed.
_STREAM_FAILURE_CODES = (grpc.StatusCode.UNAVAILABLE,)
_UNARY_FAILURE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# TransferVerdict.prefill_status_code values that make the prefill worker suspect.
_PREFILL_FAILURE_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")


class DecodeWorkerLost(ServiceError):
    """The decode worker of a stream died, hung past the inactivity deadline, or was declared
    dead by the registry, before the stream finished: the request may be migrated."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(kind, message, retry_after_s=1)


class _OpenStream:
    """One open Decode stream, as the dead-worker watch sees it."""

    __slots__ = ("worker_id", "lost")

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.lost: asyncio.Future = asyncio.get_running_loop().create_future()  # result: why


def _is_keepalive(message: decode_pb2.DecodeResponse) -> bool:
    return not (message.token_ids or message.text or message.logprobs or message.finish_reason
                or message.HasField("transfer") or message.HasField("usage"))


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
    """Decode streams, each with an inactivity deadline (the worker sends keep-alives at a
    quarter of it while it has nothing else to say) and ended at once when the registry
    declares its worker dead (`cut_off_dead`)."""

    def __init__(self, channels: WorkerChannels, registry: WorkerRegistry, tasks: BackgroundTasks,
                 idle_timeout_s: float, rpc_timeout_s: float) -> None:
        self._channels = channels
        self._registry = registry
        self._tasks = tasks
        self._idle_timeout_s = idle_timeout_s
        self._rpc_timeout_s = rpc_timeout_s
        self._open: set[_OpenStream] = set()

    @property
    def keepalive_ms(self) -> int:
        return max(1, int(self._idle_timeout_s * 1000 / 4))

    def cut_off_dead(self) -> int:
        """End every open stream whose worker the registry no longer holds alive. Returns how
        many were ended."""
        ended = 0
        for handle in list(self._open):
            record = self._registry.get(handle.worker_id)
            if not handle.lost.done() and (record is None or not self._registry.is_alive(record)):
                handle.lost.set_result(f"decode worker {handle.worker_id} was declared dead")
                ended += 1
        return ended

    async def stream(self, worker: Worker, request: decode_pb2.DecodeRequest) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """The worker's Decode stream, message by message (keep-alives left out), ending after
        the message with a finish_reason. Errors are ServiceErrors (the worker's status mapped
        back); DecodeWorkerLost when the worker is gone, hung or declared dead."""
        request.keepalive_ms = self.keepalive_ms
        call = self._channels.decode(worker.address).Decode(request)
        handle = _OpenStream(worker.worker_id)
        self._open.add(handle)
        self._registry.note_stream(worker.worker_id, +1)
        finished = False  # the last message arrived
        ended_by_worker = False  # the worker closed the call (error status or early EOF)
        try:
            while not finished:
                try:
                    message = await self._next(call, handle)
                except grpc.aio.AioRpcError as err:
                    ended_by_worker = True
                    self._note_failure(worker, err, _STREAM_FAILURE_CODES)
                    if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # it read the request, then refused
                        self._registry.note_refusal(worker.worker_id)
                    if err.code() in _STREAM_FAILURE_CODES:
                        raise DecodeWorkerLost(ErrorKind.UNAVAILABLE, f"decode worker {worker.worker_id} "
                                               f"failed mid-stream: {err.code().name}") from None
                    raise to_service_error(err) from None
                if message is grpc.aio.EOF:
                    ended_by_worker = True
                    raise DecodeWorkerLost(ErrorKind.UNAVAILABLE,
                                           f"decode worker {worker.worker_id} ended the stream without finishing")
                if _is_keepalive(message):
                    continue
                finished = message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                if finished:
                    self._registry.note_finished(worker.worker_id)
                if message.HasField("transfer"):
                    self._note_prefill_verdict(worker, request, message.transfer)
                yield message
        finally:
            self._open.discard(handle)
            self._registry.note_stream(worker.worker_id, -1)
            if not finished and not ended_by_worker:
                # Left early (consumer gone, cancelled, worker lost): cancel the call and,
                # in case the cancellation is lost, abort the request explicitly.
                call.cancel()
                self._tasks.spawn(self.abort(worker, request.request_id, "router_stream_closed"))

    async def _next(self, call: grpc.aio.UnaryStreamCall, handle: _OpenStream) -> Any:
        """The call's next message, or DecodeWorkerLost when the inactivity deadline passes or
        the worker is declared dead first. asyncio.wait, not wait_for: a cancellation of this
        task (client gone) always propagates, and the pending read is cancelled with it."""
        read = asyncio.ensure_future(call.read())
        try:
            done, _ = await asyncio.wait((read, handle.lost), timeout=self._idle_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            read.cancel()
            raise
        if read in done:
            return read.result()
        read.cancel()
        if handle.lost.done():
            self._registry.mark_suspect(handle.worker_id, handle.lost.result())
            raise DecodeWorkerLost(ErrorKind.UNAVAILABLE, handle.lost.result())
        self._registry.mark_suspect(handle.worker_id, f"a stream was silent for {self._idle_timeout_s:g} s")
        raise DecodeWorkerLost(ErrorKind.DEADLINE_EXCEEDED, f"decode worker {handle.worker_id} sent "
                                                            f"nothing for {self._idle_timeout_s:g} s")

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

    def _note_prefill_verdict(self, worker: Worker, request: decode_pb2.DecodeRequest,
                              verdict: common_pb2.TransferVerdict) -> None:
        """Decode reports a prefill worker it could not reach: stop routing to it. Only the
        prefill this router planned for the request may be named (a decode cannot take
        another worker out of routing); another name is ignored and logged."""
        if not verdict.prefill_worker_id or verdict.prefill_status_code not in _PREFILL_FAILURE_CODES:
            return
        planned = request.prefill.worker_id if request.HasField("prefill") else ""
        if verdict.prefill_worker_id != planned:
            log.warning("decode %s named %r in a verdict on %s, not its planned prefill %r: ignored",
                        worker.worker_id, verdict.prefill_worker_id, request.request_id, planned)
            return
        self._registry.mark_suspect(planned, f"decode {worker.worker_id} reported "
                                             f"{verdict.prefill_status_code}: {verdict.reason!r}")

    def _note_failure(self, worker: Worker, err: grpc.aio.AioRpcError, codes: tuple) -> None:
        if err.code() in codes:
            self._registry.mark_suspect(worker.worker_id, f"{err.code().name}: {err.details()}")

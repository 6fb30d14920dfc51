"""The Prefill gRPC service: compute a prompt, ship its KV into decode's blocks, return the
first token and the transfer verdict."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Protocol

import grpc

from pdserve.deploy.worker import (WorkerSettings, load_to_proto, logprob_to_proto, model_info,
                                   sampling_from_proto, status_of)
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.errors import PdserveError
from pdserve.proto.pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger("pdserve.prefill")


class KVSender(Protocol):
    """Prefill's side of the transfer layer (implemented in kvtransfer): turns a hand-off into
    the engine's transfer params, and reports each request's verdict once its blocks went."""

    def transfer_params(self, request_id: str, handoff: prefill_pb2.KVHandoff) -> object: ...

    async def verdict(self, request_id: str, timeout: float) -> common_pb2.TransferVerdict: ...

    def abort(self, request_id: str) -> None: ...


class PrefillService(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, loop: EngineLoop, settings: WorkerSettings, served_name: str,
                 sender: KVSender, metrics) -> None:
        self.loop = loop
        self.settings = settings
        self.served_name = served_name
        self.sender = sender
        self.metrics = metrics
        self._num_inflight = 0

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context):
        arrival = time.monotonic()
        handoff = request.handoff
        engine = self.loop.engine
        if handoff.compatibility_hash != engine.compat_hash:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"compatibility hash {handoff.compatibility_hash:#x} != ours {engine.compat_hash:#x}")
        remaining_s = handoff.deadline_unix_ms / 1000 - time.time()
        if remaining_s <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "hand-off deadline already passed")
        if self._num_inflight >= self.settings.max_queue:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "prefill queue is full")
        rid = request.request_id
        try:
            params = dataclasses.replace(sampling_from_proto(request.sampling), max_tokens=1,
                                         min_tokens=0, stop=())
            tp = self.sender.transfer_params(rid, handoff)
        except (PdserveError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._num_inflight += 1
        try:
            try:
                stream = await self.loop.add_request(list(request.prompt_token_ids), params,
                                                     request_id=rid, transfer_params=tp)
            except PdserveError as exc:
                self.sender.abort(rid)
                await context.abort(status_of(exc), str(exc))
            out = await stream.next(remaining_s)
            if isinstance(out, BaseException):
                raise out
            computed = time.monotonic()
            verdict = await self.sender.verdict(rid, max(0.1, handoff.deadline_unix_ms / 1000 - time.time()))
            self.metrics.observe_verdict(verdict)
            self.metrics.requests.labels(outcome=common_pb2.TransferOutcome.Name(verdict.outcome)).inc()
            resp = prefill_pb2.PrefillResponse(
                request_id=rid, first_token_id=out.new_token_ids[0], verdict=verdict,
                timings=prefill_pb2.PrefillTimings(compute_ms=(computed - arrival) * 1000,
                                                   transfer_ms=verdict.duration_ms),
                num_computed_tokens=out.num_prompt_tokens - out.num_cached_tokens - out.num_external_tokens,
                num_cached_tokens=out.num_cached_tokens + out.num_external_tokens)
            if out.new_logprobs:
                resp.first_token_logprob.CopyFrom(logprob_to_proto(out.new_logprobs[0], engine.tokenizer))
            return resp
        except (asyncio.CancelledError, asyncio.TimeoutError):
            self.sender.abort(rid)
            await asyncio.shield(self.loop.abort(rid))
            raise
        finally:
            self._num_inflight -= 1

    async def Abort(self, request, context):
        self.sender.abort(request.request_id)
        found = await self.loop.abort(request.request_id)
        return common_pb2.AbortResponse(found=found)

    async def ModelInfo(self, request, context):
        return model_info(self.loop.engine, self.served_name, request.include_tokenizer)

    async def Load(self, request, context):
        return load_to_proto(self.loop, num_queued_extra=self._num_inflight)

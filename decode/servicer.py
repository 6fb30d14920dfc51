"""The Decode gRPC service: admit, hand the prefill off (or prefill here), decode, stream."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from pdserve.decode.admission import AdmissionPolicy
from pdserve.decode.prefill_leg import PrefillLeg
from pdserve.deploy.worker import (WorkerSettings, load_to_proto, logprob_to_proto, model_info,
                                   sampling_from_proto, status_of)
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.errors import PdserveError
from pdserve.proto.block_hash import hash_prompt_blocks
from pdserve.proto.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

log = logging.getLogger("pdserve.decode")

FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
          "abort": common_pb2.FINISH_REASON_ABORT, "error": common_pb2.FINISH_REASON_ABORT}
STEP_TIMEOUT_S = 120.0  # longest silence between two deltas of one request


class DecodeService(decode_pb2_grpc.DecodeServicer):
    def __init__(self, loop: EngineLoop, settings: WorkerSettings, served_name: str,
                 prefill_leg: PrefillLeg, metrics) -> None:
        self.loop = loop
        self.settings = settings
        self.served_name = served_name
        self.leg = prefill_leg
        self.metrics = metrics
        self.policy = AdmissionPolicy(settings.local_prefill_threshold, settings.prefill_queue_threshold)
        self._tasks: dict[str, asyncio.Task] = {}

    async def Decode(self, request: decode_pb2.DecodeRequest, context):
        rid = request.request_id or uuid.uuid4().hex
        try:
            params = sampling_from_proto(request.sampling)
        except PdserveError as exc:
            await context.abort(status_of(exc), str(exc))
        engine = self.loop.engine
        ids = list(request.prompt_token_ids)
        hashes = list(request.block_hashes) or hash_prompt_blocks(ids, engine.kv.block_size, engine.compat_hash)
        # how much of the prompt this worker holds already decides local vs remote
        cached = await self.loop.call(lambda: self._cached_tokens(ids, hashes))
        decision = self.policy.decide(len(ids), cached, request.prefill.address, request.prefill.reason,
                                      request.prefill.queue_length, self.leg.can_receive)
        t_arrival = time.monotonic()
        try:
            stream = await self.loop.add_request(ids, params, request_id=rid, remote_prefill=decision.remote)
        except PdserveError as exc:
            self.metrics.requests.labels(outcome="rejected").inc()
            await context.abort(status_of(exc), str(exc))
        verdict = common_pb2.TransferVerdict(outcome=common_pb2.TRANSFER_OUTCOME_LOCAL, reason=decision.reason)
        timings = common_pb2.RequestTimings()
        try:
            if decision.remote:
                verdict, ok = await self._prefill_remotely(rid, ids, hashes, request, stream, timings, t_arrival)
                if not ok:
                    await context.abort(grpc.StatusCode.ABORTED,
                                        f"prefill failed and failure policy is 'fail': {verdict.reason}")
            self.metrics.prefill_decisions.labels(outcome=common_pb2.TransferOutcome.Name(verdict.outcome),
                                                  reason=verdict.reason.split(":")[0]).inc()
            first = True
            async for response in self._stream(stream, rid):
                if first:
                    response.transfer.CopyFrom(verdict)
                    timings.first_decode_ms = (time.monotonic() - t_arrival) * 1000 - timings.queue_ms - timings.prefill_ms
                    first = False
                if response.finish_reason:
                    response.transfer.CopyFrom(verdict)
                    response.timings.CopyFrom(timings)
                yield response
            self.metrics.requests.labels(outcome="ok").inc()
        except asyncio.CancelledError:
            self.metrics.requests.labels(outcome="cancelled").inc()
            await self._abort(rid, "cancelled")
            raise
        except Exception:
            await self._abort(rid, "error")
            raise

    def _cached_tokens(self, ids, hashes) -> int:
        engine = self.loop.engine
        n = 0
        for h in hashes[: (len(ids) - 1) // engine.kv.block_size]:
            if engine.kv.pool.get_cached_block(h) is None:
                break
            n += engine.kv.block_size
        return n

    async def _prefill_remotely(self, rid, ids, hashes, request, stream, timings, t_arrival):
        ready = await asyncio.wait_for(stream.remote_ready, self.settings.prefill_timeout_s)
        if ready is None:  # aborted while waiting for admission: the stream carries the end
            return common_pb2.TransferVerdict(outcome=common_pb2.TRANSFER_OUTCOME_FAILED,
                                              reason="aborted"), True
        block_ids, num_cached = ready
        t_admitted = time.monotonic()
        timings.queue_ms = (t_admitted - t_arrival) * 1000
        result = await self.leg.run(rid, ids, hashes, request.sampling, request.prefill,
                                    block_ids, num_cached)
        timings.prefill_ms = (time.monotonic() - t_admitted) * 1000
        timings.transfer_ms = result.verdict.duration_ms
        if result.aborted:
            return result.verdict, True  # the engine ends the stream with finish_reason abort
        if result.ok:
            await self.loop.call(lambda: self.loop.engine.finish_remote_prefill(
                rid, result.first_token_id, result.first_logprob))
            return result.verdict, True
        if self.settings.failure_policy == "recompute":
            result.verdict.outcome = common_pb2.TRANSFER_OUTCOME_RECOMPUTED
            log.warning("request %s: prefill leg failed (%s); recomputing here", rid, result.verdict.reason)
            await self.loop.call(lambda: self.loop.engine.recompute_remote_prefill(rid))
            return result.verdict, True
        result.verdict.outcome = common_pb2.TRANSFER_OUTCOME_FAILED
        log.warning("request %s: prefill leg failed (%s); failing it", rid, result.verdict.reason)
        await self._abort(rid, "prefill_failed")
        return result.verdict, False

    async def _stream(self, stream, rid):
        tok = self.loop.engine.tokenizer
        while True:
            out = await stream.next(STEP_TIMEOUT_S)
            if isinstance(out, BaseException):
                raise out
            resp = decode_pb2.DecodeResponse(request_id=rid, token_ids=list(out.new_token_ids),
                                             text=out.new_text)
            for lp in out.new_logprobs:
                resp.logprobs.append(logprob_to_proto(lp, tok))
            if out.finished:
                resp.finish_reason = FINISH.get(out.finish_reason, common_pb2.FINISH_REASON_STOP)
                resp.usage.CopyFrom(common_pb2.Usage(
                    prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                    cached_prompt_tokens=out.num_cached_tokens))
                yield resp
                return
            yield resp

    async def _abort(self, rid: str, why: str) -> bool:
        await self.leg.abort(rid)
        try:
            return await asyncio.shield(self.loop.abort(rid))
        except Exception:
            return False

    async def Abort(self, request, context):
        found = await self._abort(request.request_id, request.reason or "abort_rpc")
        return common_pb2.AbortResponse(found=found)

    async def ModelInfo(self, request, context):
        return model_info(self.loop.engine, self.served_name, request.include_tokenizer)

    async def Load(self, request, context):
        return load_to_proto(self.loop)

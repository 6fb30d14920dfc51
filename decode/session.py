"""One decode request from admission to its last token: place the prefill, admit the request
into the engine, run the prefill leg (or prefill here), stream the deltas as proto messages.
Errors are typed (`pdserve.common.errors`); the servicer's decorator maps them onto gRPC."""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import AsyncIterator, Callable, TypeVar

from pdserve.common.errors import DeadlinePassedError
from pdserve.decode.placement import Placement, place
from pdserve.decode.prefill_leg import LegResult, RemotePrefill
from pdserve.engine.engine_loop import EngineLoop
from pdserve.kvtransfer.verdict import NO_TRANSFER, Outcome, RequestVerdict
from pdserve.proto.pdserve.v1 import common_pb2, decode_pb2
from pdserve.worker.convert import logprob_to_proto, sampling_from_proto
from pdserve.worker.lora import LoraSettings, WorkerAdapters
from pdserve.worker.transfer import request_verdict_to_proto

FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
          "abort": common_pb2.FINISH_REASON_ABORT, "error": common_pb2.FINISH_REASON_ABORT}
STEP_TIMEOUT_S = 120.0  # longest silence between two deltas of one request
T = TypeVar("T")


async def keep_alive(stream: AsyncIterator[T], interval_s: float, make: Callable[[], T]) -> AsyncIterator[T]:
    """`stream`'s items, with `make()` in between whenever it is silent for `interval_s`.
    The pending read survives a keep-alive (it is not cancelled); closing this generator
    cancels it and closes `stream`."""
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(stream))
            done, _ = await asyncio.wait((pending,), timeout=interval_s)
            if not done:
                yield make()
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await stream.aclose()


class DecodeSessions:
    """Runs Decode requests on one engine loop; `abort` ends one at any phase."""

    def __init__(self, loop: EngineLoop, remote: RemotePrefill, metrics, adapters: WorkerAdapters | None = None) -> None:
        """`adapters`: the worker's LoRA adapters (none: LoRA off, every adapter name is NOT_FOUND)."""
        self.loop = loop
        self.remote = remote
        self.metrics = metrics
        self.adapters = adapters or WorkerAdapters(loop, LoraSettings())

    async def run(self, request: decode_pb2.DecodeRequest) -> AsyncIterator[decode_pb2.DecodeResponse]:
        rid = request.request_id or uuid.uuid4().hex
        params = sampling_from_proto(request.sampling)
        resumed = list(request.resumed_token_ids)
        placement = (Placement(False, "resumed") if resumed else
                     place(request.prefill.address, request.prefill.reason, self.remote.can_receive))
        t_arrival = time.monotonic()
        try:
            # the adapter is this worker's before the request is: loaded here on first use
            lora_digest = await self.adapters.ensure(request.lora_name)
            stream = await self.loop.add_request(list(request.prompt_token_ids), params, request_id=rid,
                                                 remote_prefill=placement.remote, resumed=resumed,
                                                 cache_salt=request.cache_salt, lora_name=request.lora_name or None)
        except Exception:  # counted, then re-raised
            self.metrics.requests.labels(outcome="rejected").inc()
            raise
        timings = common_pb2.RequestTimings()
        decided, leg = RequestVerdict.local(placement.reason), LegResult(NO_TRANSFER)
        try:
            if placement.remote:
                decided, leg = await self.remote.run(rid, request, stream, timings, t_arrival, lora_digest)
            verdict = request_verdict_to_proto(decided)  # the request's verdict leaves this process
            self.metrics.prefill_decisions.labels(outcome=common_pb2.TransferOutcome.Name(verdict.outcome),
                                                  reason=verdict.reason.split(":")[0]).inc()
            first = True
            transferred = decided.outcome == Outcome.TRANSFERRED
            if transferred:  # what the link from that prefill worker delivers, for the router
                self.metrics.observe_received(leg.verdict, leg.tail_ms)
            async for out, response in self._stream(stream, rid, (leg.num_cached_tokens, leg.cached_tokens_by_tier)
                                                    if transferred else None):
                if first and (out.new_token_ids or out.finished):
                    first = False
                    response.transfer.CopyFrom(verdict)
                    self._time_first_token(timings, out, t_arrival, placement.remote, transferred)
                    response.timings.CopyFrom(timings)  # the router keeps them if this stream is lost
                if response.finish_reason:
                    response.transfer.CopyFrom(verdict)
                    response.timings.CopyFrom(timings)
                yield response
            self.metrics.requests.labels(outcome="ok").inc()
        except asyncio.CancelledError:
            self.metrics.requests.labels(outcome="cancelled").inc()
            await self.abort(rid)
            raise
        except BaseException:
            await self.abort(rid)
            raise

    def _time_first_token(self, timings: common_pb2.RequestTimings, out, t_arrival: float,
                          remote: bool, transferred: bool) -> None:
        """The TTFT phases, on the first delta. A remote prefill set queue (admission), prefill
        (the leg) and transfer (its tail) already; a local one is timed by the engine: queue
        until its first chunk was scheduled, prefill until its first token was sampled. A
        prompt recomputed here after its leg failed: prefill runs from admission (the failed
        leg and the recompute) until its first token was sampled. A resumed request (another
        decode's, migrated here) is local: its prefill is the prompt's and the resumed tokens'.
        First decode is the rest, up to this delta. They leave with this delta and the last."""
        now = time.monotonic()
        if remote and transferred:
            timings.first_decode_ms = max(0.001, (now - t_arrival) * 1000 - timings.queue_ms - timings.prefill_ms)
        elif remote:
            sampled = out.first_token_time or now
            timings.prefill_ms = max(0.0, (sampled - t_arrival) * 1000 - timings.queue_ms)
            timings.first_decode_ms = max(0.001, (now - sampled) * 1000)
        else:
            scheduled = out.first_scheduled_time or t_arrival
            sampled = out.first_token_time or now
            timings.queue_ms = max(0.0, scheduled - t_arrival) * 1000
            timings.prefill_ms = max(0.0, sampled - scheduled) * 1000
            timings.first_decode_ms = max(0.001, (now - sampled) * 1000)
        for phase, ms in (("queue", timings.queue_ms), ("prefill", timings.prefill_ms),
                          ("transfer", timings.transfer_ms), ("first_decode", timings.first_decode_ms)):
            self.metrics.ttft_phase.labels(phase).observe(ms / 1000)

    async def _stream(self, stream, rid: str, cached_remote: tuple[int, tuple] | None):
        """(engine output, its proto message) per delta. Usage counts as cached the prompt
        tokens not computed for this request: with KV from a prefill service, those it found
        cached (`cached_remote`: a prefix only this decode held was computed there
        anyway); else those this engine found in its prefix cache or loaded from a tier below
        it. `cached_remote`: (the prefill's count, its tiers' share) or None."""
        tok = self.loop.engine.tokenizer
        while True:
            try:
                out = await stream.next(STEP_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise DeadlinePassedError(f"no token for {STEP_TIMEOUT_S:g} s") from None
            if isinstance(out, BaseException):
                raise out
            resp = decode_pb2.DecodeResponse(request_id=rid, token_ids=list(out.new_token_ids),
                                             text=out.new_text)
            resp.logprobs.extend(logprob_to_proto(lp, tok) for lp in out.new_logprobs)
            if out.prompt_logprobs is not None:
                resp.prompt_logprobs.extend(logprob_to_proto(lp, tok) for lp in out.prompt_logprobs)
            if out.finished:
                resp.finish_reason = FINISH.get(out.finish_reason, common_pb2.FINISH_REASON_STOP)
                cached, by_tier = ((out.num_cached_tokens + out.num_loaded_tokens, out.cached_tokens_by_tier)
                                   if cached_remote is None else cached_remote)
                resp.usage.CopyFrom(common_pb2.Usage(
                    prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                    cached_prompt_tokens=min(cached, out.num_prompt_tokens),
                    accepted_draft_tokens=out.num_accepted_tokens,
                    rejected_draft_tokens=out.num_draft_tokens - out.num_accepted_tokens,
                    draft_steps=out.num_draft_steps, cached_tokens_by_tier=dict(by_tier)))
                yield out, resp
                return
            yield out, resp

    async def abort(self, rid: str) -> bool:
        """End `rid` wherever it is: cancel its prefill leg, free its blocks."""
        await self.remote.leg.abort(rid)
        try:
            return await asyncio.shield(self.loop.abort(rid))
        except Exception:  # noqa: BLE001 - the loop is stopping; nothing is left to free
            return False

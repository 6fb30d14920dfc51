"""One prefill request: check the hand-off, compute the prompt (its KV leaves through the
connector into the decode's blocks), wait for the transfer verdict, answer with the first
token. Errors are typed (`pdserve.common.errors`); the servicer maps them onto gRPC."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from pdserve.common.block_hash import PromptBlocks, check_cache_salt
from pdserve.common.errors import (AlreadyExistsError, DeadlinePassedError, IncompatiblePeerError,
                                   InvalidRequestError, OverloadedError, PdserveError)
from pdserve.engine.engine_loop import EngineLoop
from pdserve.kvtransfer.params import TransferParams
from pdserve.kvtransfer.ports import SendControl
from pdserve.kvtransfer.verdict import Landing, TransferVerdict
from pdserve.worker.transfer import check_handoff_signature, handoff_to_params, verdict_to_proto
from pdserve.proto.pdserve.v1 import common_pb2, prefill_pb2
from pdserve.security.handoffs import MAX_HANDOFF_HORIZON_S, HandoffLedger, check_presenter
from pdserve.security.secret import Mac
from pdserve.worker.convert import logprob_to_proto, sampling_from_proto
from pdserve.worker.lora import LoraSettings, WorkerAdapters

log = logging.getLogger("pdserve.prefill")


def first_token_params(params):
    """The request's sampling settings for its first token only. Everything that shapes the
    first draw (seed, min_tokens' EOS/stop-token suppression, penalties, constraints) is kept,
    so the token equals what a local prefill would draw; stop strings are checked by decode,
    which sees the token before streaming it."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=())


class PrefillRunner:
    def __init__(self, loop: EngineLoop, sends: SendControl, metrics, *, block_size: int, max_queue: int,
                 handoff_mac: Mac | None = None, ledger: HandoffLedger | None = None,
                 core_share=None, adapters: WorkerAdapters | None = None) -> None:
        """`sends`: the transfer layer's send side (`PdConnector.sends`); `block_size`: the
        engine's, that of the hand-offs' block counts. With `handoff_mac`, a hand-off must carry a decode's valid signature over it and its
        request, and come from the decode it names. Each hand-off is accepted once (`ledger`).
        With a `core_share` (worker.core_share), a prompt that arrives while every other
        worker of the machine is idle is sent whole after its forward: that forward takes
        their cores too, and per-layer sends would preempt its threads. `adapters`: the
        worker's LoRA adapters (none: LoRA off, a hand-off naming one is NOT_FOUND)."""
        self.loop = loop
        self.adapters = adapters or WorkerAdapters(loop, LoraSettings())
        self.handoff_mac = handoff_mac
        self.ledger = ledger or HandoffLedger()
        self.sends = sends
        self.block_size = block_size
        self.metrics = metrics
        self.max_queue = max_queue
        self.num_inflight = 0
        self.core_share = core_share
        self._owners: dict[str, str] = {}  # request id -> the decode its hand-off names, while run() holds it

    def _check_signed(self, request: prefill_pb2.PrefillRequest, caller: str) -> None:
        """The hand-off is signed for this request, by the decode that calls (with a mac)."""
        if self.handoff_mac is not None:
            check_handoff_signature(request, self.handoff_mac)
            check_presenter(request.handoff.decode_worker_id, caller)

    def _check(self, request: prefill_pb2.PrefillRequest, caller: str) -> tuple[float, PromptBlocks]:
        """Seconds left of the hand-off's deadline and the prompt's blocks, after the checks
        that need no model work: signed (`_check_signed`, called first), compatible, in time,
        new."""
        handoff = request.handoff
        ours = self.loop.engine.compat_hash
        if handoff.compatibility_hash != ours:
            raise IncompatiblePeerError(f"compatibility hash {handoff.compatibility_hash:#x} != ours {ours:#x}")
        remaining_s = handoff.deadline_unix_ms / 1000 - time.time()
        if remaining_s <= 0:
            raise DeadlinePassedError("hand-off deadline already passed")
        if remaining_s > MAX_HANDOFF_HORIZON_S:
            raise InvalidRequestError(f"the hand-off's deadline is over {MAX_HANDOFF_HORIZON_S:g} s ahead")
        blocks = self._check_block_hashes(request)
        if request.request_id in self._owners:  # refused before its hand-off is spent; the first runs on
            raise AlreadyExistsError(f"request {request.request_id!r} is already being prefilled here")
        if self.num_inflight >= self.max_queue:
            raise OverloadedError("prefill queue is full")
        self.ledger.accept(handoff.transfer_id, handoff.deadline_unix_ms / 1000)
        return remaining_s, blocks

    def _check_block_hashes(self, request: prefill_pb2.PrefillRequest) -> PromptBlocks:
        """Our blocks of the prompt; the decode's block hashes, when it sent them, must be
        ours of the same prompt (and cache salt): they are what the decode's sink will
        accept, and what its signature bound."""
        check_cache_salt(request.cache_salt)
        lora = (request.handoff.lora_name,) if request.handoff.lora_name else ()  # keyed by its digest
        ours = self.loop.engine.prompt_blocks(request.prompt_token_ids, request.cache_salt, *lora)
        if request.block_hashes and list(request.block_hashes) != ours.hashes:
            raise InvalidRequestError("block_hashes do not match the prompt's blocks", param="block_hashes")
        return ours

    async def run(self, request: prefill_pb2.PrefillRequest, caller: str = "") -> prefill_pb2.PrefillResponse:
        """`caller`: the verified caller id of the call (rpc.credentials.caller_id)."""
        arrival = time.monotonic()
        handoff, rid = request.handoff, request.request_id
        self._check_signed(request, caller)
        # the adapter is part of the compatibility check: the decode's digest must be ours
        # (its block hashes are keyed by it too)
        await self.adapters.ensure(handoff.lora_name)
        self.adapters.check_handoff(handoff.lora_name, handoff.lora_digest)
        remaining_s, blocks = self._check(request, caller)
        tp = handoff_to_params(handoff, self.block_size)
        refusal = self._refusal(tp, handoff.transfer_id)
        if refusal is not None:  # the KV could go nowhere: computing it would be wasted work
            self.metrics.requests.labels(outcome="SKIPPED_NO_USABLE_BACKEND").inc()
            return prefill_pb2.PrefillResponse(request_id=rid, verdict=refusal, skipped=True)
        params = first_token_params(sampling_from_proto(request.sampling))
        self.sends.connect_ahead(tp)  # first contact: connect while the prompt computes
        self._owners[rid] = handoff.decode_worker_id
        self.num_inflight += 1
        stream_layers = self.core_share is None or not self.core_share.others_idle()
        try:
            stream = await self._add(request, params, tp, stream_layers, blocks)
            return await self._answer(request, stream, remaining_s, arrival)
        finally:
            self.num_inflight -= 1
            del self._owners[rid]

    def _refusal(self, tp: TransferParams, transfer_id: str) -> common_pb2.TransferVerdict | None:
        """None when some backend could carry the hand-off's blocks now; else the verdict
        (KV missing, reason no_usable_kv_backend, a fallback per backend) that spares
        computing the prompt only to throw its KV away."""
        skipped = self.sends.unusable(tp)
        if not skipped:
            return None
        why = "no_usable_kv_backend: " + "; ".join(f"{f.backend}: {f.reason}" for f in skipped)
        return verdict_to_proto(TransferVerdict(transfer_id, Landing.MISSING, "", fallbacks=tuple(skipped),
                                                reason=why))

    async def _verdict(self, rid: str, timeout_s: float) -> tuple[common_pb2.TransferVerdict, float]:
        """(the send's verdict, its tail in ms: end of the prompt's forward to the verdict in
        hand, the transfer time not overlapped with compute; 0 when no send ran)."""
        v = await asyncio.to_thread(self.sends.wait_verdict, rid, timeout_s)
        if v is None:
            v = TransferVerdict("", Landing.MISSING, "", reason="transfer_failed: no verdict before the deadline")
        return verdict_to_proto(v), v.tail_s * 1000

    async def _add(self, request: prefill_pb2.PrefillRequest, params, tp, stream_layers: bool,
                   blocks: PromptBlocks):
        """The request's stream from the engine. A refusal by the engine (a typed error) added
        nothing, so nothing is ended: the id may be another request's, whose blocks stay
        until its send ends. A wait that ends otherwise may end after the add: ended."""
        try:
            return await self.loop.add_request(list(request.prompt_token_ids), params,
                                               request_id=request.request_id, transfer_params=tp,
                                               cache_salt=request.cache_salt, stream_layers=stream_layers,
                                               blocks=blocks, lora_name=request.handoff.lora_name or None)
        except PdserveError:
            raise
        except BaseException:
            await self._end(request.request_id)
            raise

    async def _answer(self, request: prefill_pb2.PrefillRequest, stream, remaining_s: float,
                      arrival: float) -> prefill_pb2.PrefillResponse:
        """The first token and the send's verdict; any other end (error, cancel, deadline)
        ends the request."""
        rid, deadline_s = request.request_id, request.handoff.deadline_unix_ms / 1000
        try:
            try:
                out = await stream.next(remaining_s)
            except asyncio.TimeoutError:
                raise DeadlinePassedError("prefill did not finish before the hand-off deadline") from None
            if isinstance(out, BaseException):
                raise out
            computed = time.monotonic()
            verdict, tail_ms = await self._verdict(rid, max(0.1, deadline_s - time.time()))
            self.metrics.observe_verdict(verdict, tail_ms)
            self.metrics.requests.labels(outcome=common_pb2.TransferOutcome.Name(verdict.outcome)).inc()
            return self._response(rid, out, verdict, (computed - arrival) * 1000, tail_ms)
        except BaseException:
            await self._end(rid)
            raise

    async def _end(self, rid: str) -> None:
        """End `rid` wherever it is: a send not started never starts, and the engine lets its
        blocks go (after a send under way ends, within the hand-off's deadline)."""
        self.sends.abort_send(rid)
        await asyncio.shield(self.loop.abort(rid))

    def _response(self, rid: str, out, verdict, compute_ms: float,
                  tail_ms: float) -> prefill_pb2.PrefillResponse:
        resp = prefill_pb2.PrefillResponse(
            request_id=rid, first_token_id=out.new_token_ids[0], verdict=verdict,
            timings=prefill_pb2.PrefillTimings(compute_ms=compute_ms, transfer_ms=tail_ms),
            num_computed_tokens=out.num_prompt_tokens - out.num_cached_tokens - out.num_external_tokens,
            num_cached_tokens=out.num_cached_tokens + out.num_external_tokens,
            cached_tokens_by_tier=dict(out.cached_tokens_by_tier))
        tok = self.loop.engine.tokenizer
        if out.new_logprobs:
            resp.first_token_logprob.CopyFrom(logprob_to_proto(out.new_logprobs[0], tok))
        if out.prompt_logprobs is not None:
            resp.prompt_logprobs.extend(logprob_to_proto(lp, tok) for lp in out.prompt_logprobs)
        return resp

    async def abort(self, rid: str, caller: str = "") -> bool:
        """End `rid` for `caller` (the verified caller id). With signed hand-offs only the
        decode that the request's hand-off names may; another caller finds nothing."""
        if self.handoff_mac is not None and self._owners.get(rid) != caller:
            log.warning("abort of request %r by %r refused: no request of that decode here", rid, caller)
            return False
        self.sends.abort_send(rid)
        return await self.loop.abort(rid)


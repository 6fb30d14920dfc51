"""The prefill leg of one disaggregated request, seen from decode.

Decode has allocated the prompt's blocks. It tells its KV receiver to expect a transfer into
the uncached ones, asks the prefill worker to fill them (Prefill RPC with a KVHandoff),
and checks that what the verdict claims really arrived. No wait is unbounded: the RPC has
the hand-off deadline, and a prefill that becomes unreachable ends it within seconds (its
channel does not connect, or its keepalive goes unanswered); an abort cancels the RPC and the
expected transfer, so no late write lands in a freed block.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Sequence

import grpc

from pdserve.common.errors import DeadlinePassedError, UpstreamFailedError
from pdserve.rpc.channels import CONNECT_TIMEOUT_S, WorkerChannels
from pdserve.rpc.credentials import InternalAuth
from pdserve.worker.convert import logprob_from_proto
from pdserve.kvtransfer.ports import ReceiveControl
from pdserve.kvtransfer.verdict import Landing, Outcome, RequestVerdict, TransferVerdict, decide
from pdserve.proto.pdserve.v1 import common_pb2, prefill_pb2

log = logging.getLogger("pdserve.decode.prefill_leg")


@dataclass(frozen=True, slots=True)
class LegResult:
    """How a prefill leg ended: its transfer's verdict says whether the KV landed here
    (LANDED, MISSING with its reason, ABORTED); what the request does about it is decided
    apart (`RemotePrefill.run`, `verdict.decide`)."""

    verdict: TransferVerdict
    first_token_id: int = 0
    first_logprob: object | None = None
    tail_ms: float = 0.0  # the transfer after the prefill's forward, to the blocks verified here
    prompt_logprobs: tuple = ()  # sampling.prompt_logprobs: computed by the prefill
    num_cached_tokens: int = 0  # prompt tokens the prefill found cached (its prefix cache, its store)
    cached_tokens_by_tier: tuple[tuple[str, int], ...] = ()  # of those, by tier ("device", "host", ...)

    @property
    def ok(self) -> bool:
        return self.verdict.ok


class _NotConnected(Exception):
    """The channel to a prefill did not connect in time; read like an UNAVAILABLE call."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return f"{self.args[0]} not connected within {CONNECT_TIMEOUT_S:g} s"


class PrefillLeg:
    def __init__(self, receives: ReceiveControl, *, worker_id: str, compat_hash: int,
                 block_size: int, timeout_s: float, auth: InternalAuth = InternalAuth(None)) -> None:
        """`receives`: the transfer layer's receive side (`worker.transfer.AdvertisedReceives`,
        or `NoReceives`). With `auth` enabled, every Prefill call carries this decode's
        credential and every hand-off its signature."""
        self.receives = receives
        self._channels = WorkerChannels(auth.signer(worker_id), auth.tls)
        self._handoff_mac = auth.handoff_mac()
        self.worker_id = worker_id
        self.compat_hash = compat_hash
        self.block_size = block_size
        self.timeout_s = timeout_s
        self._inflight: dict[str, asyncio.Task] = {}
        self._aborted: set[str] = set()

    @property
    def can_receive(self) -> bool:
        return bool(self.receives.endpoints)

    async def run(self, request_id: str, prompt_ids: list[int], block_hashes: list[int],
                  sampling: common_pb2.SamplingParams, choice, block_ids: Sequence[int],
                  num_cached_tokens: int, cache_salt: str = "", lora: tuple[str, str] = ("", "")) -> LegResult:
        """`block_hashes`: this decode's own hashes of the prompt's full blocks (cache salt
        included): the hand-off's signature binds them, the receiver accepts only them.
        `lora`: (name, digest) of the adapter the prompt runs under (empty: the base model);
        the prefill computes under the same adapter or refuses."""
        from pdserve.worker.transfer import params_to_handoff, sign_handoff, verdict_from_proto

        start = time.monotonic()
        tp = self.receives.prepare_receive(request_id, block_ids, len(prompt_ids),
                                           num_cached_tokens // self.block_size, time.time() + self.timeout_s,
                                           block_hashes=block_hashes)
        handoff = params_to_handoff(tp, block_ids, self.block_size, self.worker_id)
        handoff.lora_name, handoff.lora_digest = lora
        request = prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                             block_hashes=block_hashes, sampling=sampling, handoff=handoff,
                                             cache_salt=cache_salt)
        if self._handoff_mac is not None:
            sign_handoff(request, self._handoff_mac)
        failed = TransferVerdict(handoff.transfer_id, Landing.MISSING, "", peer=choice.worker_id)
        task = asyncio.ensure_future(self._prefill(choice.address, request, start + self.timeout_s))
        self._inflight[request_id] = task
        try:
            resp: prefill_pb2.PrefillResponse = await task
        except asyncio.CancelledError:
            if request_id not in self._aborted:
                raise  # our own caller was cancelled
            self._aborted.discard(request_id)
            return LegResult(replace(failed, landing=Landing.ABORTED, reason="aborted"))
        except (grpc.aio.AioRpcError, _NotConnected) as exc:
            self.receives.cancel_receive(request_id)
            return LegResult(replace(
                failed, peer_status=exc.code().name, duration_s=time.monotonic() - start,
                reason=f"prefill_unavailable: {exc.code().name} {exc.details() or ''}".strip()))
        finally:
            self._inflight.pop(request_id, None)
        sent = replace(verdict_from_proto(resp.verdict), peer=choice.worker_id)
        if resp.skipped:  # no KV backend could carry the blocks: the prefill computed nothing
            self.receives.cancel_receive(request_id)
            return LegResult(replace(sent, landing=Landing.MISSING, duration_s=time.monotonic() - start))
        settle_start = time.monotonic()
        final = await asyncio.to_thread(self.receives.complete_receive, request_id, sent)
        tail_ms = resp.timings.transfer_ms + (time.monotonic() - settle_start) * 1000
        if not final.ok:
            return LegResult(final, tail_ms=tail_ms)
        lp = logprob_from_proto(resp.first_token_logprob) if resp.HasField("first_token_logprob") else None
        return LegResult(final, resp.first_token_id, lp, tail_ms=tail_ms,
                         prompt_logprobs=tuple(logprob_from_proto(e) for e in resp.prompt_logprobs),
                         num_cached_tokens=resp.num_cached_tokens,
                         cached_tokens_by_tier=tuple(sorted(resp.cached_tokens_by_tier.items())))

    async def _prefill(self, address: str, request: prefill_pb2.PrefillRequest,
                       deadline: float) -> prefill_pb2.PrefillResponse:
        """The Prefill call, due by `deadline`, once its channel is connected. A prefill that
        becomes unreachable ends it UNAVAILABLE within seconds: the channel does not connect
        within CONNECT_TIMEOUT_S, or its keepalive goes unanswered (rpc.server)."""
        if not await self._channels.wait_ready(address, min(CONNECT_TIMEOUT_S, deadline - time.monotonic())):
            raise _NotConnected(address)
        return await self._channels.prefill(address).Prefill(request, timeout=max(0.001, deadline - time.monotonic()))

    async def abort(self, request_id: str) -> None:
        """Cancel the leg of `request_id` if one runs: the RPC, then the reservation."""
        task = self._inflight.pop(request_id, None)
        if task is not None:
            self._aborted.add(request_id)
            task.cancel()
        self.receives.cancel_receive(request_id)

    async def close(self) -> None:
        await self._channels.close()


class RemotePrefill:
    """The remote prefill of one admitted request, with decode's failure policy: wait for the
    engine to reserve the prompt's blocks, run the leg, then either hand the first token to
    the engine, recompute the prompt here (`recompute`), or fail the request (`fail`:
    `UpstreamFailedError`). The request's verdict it returns says which, always, beside the
    leg's result."""

    def __init__(self, leg: PrefillLeg, loop, *, failure_policy: str, timeout_s: float) -> None:
        self.leg = leg
        self.loop = loop
        self.failure_policy = failure_policy
        self.timeout_s = timeout_s

    @property
    def can_receive(self) -> bool:
        return self.leg.can_receive

    async def run(self, rid: str, request, stream, timings: common_pb2.RequestTimings,
                  t_arrival: float, lora_digest: str = "") -> tuple[RequestVerdict, LegResult]:
        try:
            ready = await asyncio.wait_for(stream.remote_ready, self.timeout_s)
        except asyncio.TimeoutError:
            raise DeadlinePassedError(f"not admitted within {self.timeout_s:g} s") from None
        if ready is None:  # aborted while waiting for admission: the stream carries the end
            aborted = TransferVerdict("", Landing.ABORTED, "", reason="aborted")
            return decide(aborted, self.failure_policy), LegResult(aborted)
        block_ids, num_cached = ready
        t_admitted = time.monotonic()
        timings.queue_ms = (t_admitted - t_arrival) * 1000
        # the engine's own hashes, never the router's: the sink checks blocks against them
        result = await self.leg.run(rid, list(request.prompt_token_ids), list(stream.block_hashes), request.sampling,
                                    request.prefill, block_ids, num_cached, request.cache_salt,
                                    (request.lora_name, lora_digest))
        timings.prefill_ms = (time.monotonic() - t_admitted) * 1000
        timings.transfer_ms = result.tail_ms  # the transfer's tail: not overlapped with compute
        verdict = decide(result.verdict, self.failure_policy)
        engine = self.loop.engine
        if verdict.outcome == Outcome.TRANSFERRED:
            await self.loop.call(lambda: engine.finish_remote_prefill(
                rid, result.first_token_id, result.first_logprob, result.prompt_logprobs))
        elif verdict.outcome == Outcome.RECOMPUTED:
            log.warning("request %s: prefill leg failed (%s); recomputing here", rid, verdict.reason)
            await self.loop.call(lambda: engine.recompute_remote_prefill(rid))
        elif verdict.outcome == Outcome.FAILED:
            log.warning("request %s: prefill leg failed (%s); failing it", rid, verdict.reason)
            raise UpstreamFailedError(f"prefill failed and failure policy is 'fail': {verdict.reason}")
        # ABORTED: the engine ends the stream with finish_reason abort
        return verdict, result

"""One request's way through the router, shared by the HTTP and gRPC edges:

    admit (queue bound) -> resolve model -> prompt ids + block hashes -> validate sampling
    -> plan (decode, prefill) -> Decode stream -> GenerateResponse messages

A decode worker that is unreachable, or refuses for load, before sending anything is
replaced by another one (at most MAX_ATTEMPTS workers). Outcomes, TTFT and inter-token
latency are recorded here.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from pdserve.common.block_hash import hash_prompt_blocks
from pdserve.common.errors import ErrorKind, ServiceError
from pdserve.proto.pdserve.v1 import common_pb2, decode_pb2, generation_pb2
from pdserve.router.cpu_pool import CpuPool
from pdserve.router.admission import InFlight
from pdserve.router.catalog import ModelCatalog, ServedModel
from pdserve.router.dispatch import DecodeClient
from pdserve.router.metrics import RouterMetrics
from pdserve.router.planner import RoutePlan, RoutePlanner
from pdserve.router.validation import check_prompt_fits, resolve_sampling

log = logging.getLogger("pdserve.router.frontend")

MAX_ATTEMPTS = 3
_RETRYABLE = (ErrorKind.UNAVAILABLE, ErrorKind.RATE_LIMITED)


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    request_id: str
    model: ServedModel
    prompt_token_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    sampling: common_pb2.SamplingParams  # resolved
    session_key: str


class Frontend:
    def __init__(self, catalog: ModelCatalog, planner: RoutePlanner, decode: DecodeClient,
                 in_flight: InFlight, metrics: RouterMetrics, cpu: CpuPool | None = None) -> None:
        self._catalog = catalog
        self._cpu = cpu or CpuPool()
        self._planner = planner
        self._decode = decode
        self._in_flight = in_flight
        self._metrics = metrics

    async def generate(self, request: generation_pb2.GenerateRequest, api: str) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Stream the request's GenerateResponses. Raises ServiceError (before or during the
        stream). Closing the iterator early aborts the request on its decode worker."""
        outcome = "aborted"  # unless it ends otherwise: the consumer left
        try:
            request_id = request.request_id or f"req-{uuid.uuid4().hex}"
            with self._in_flight.admit(request_id):
                async with contextlib.aclosing(self._run(request, request_id)) as responses:
                    async for response in responses:
                        if response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                            outcome = "aborted" if response.finish_reason == common_pb2.FINISH_REASON_ABORT else "ok"
                        yield response
        except ServiceError as err:
            outcome = err.outcome
            raise
        except Exception:
            outcome = "error"
            raise
        finally:
            self._metrics.requests.labels(api, outcome).inc()

    async def run_cpu(self, fn, *args):
        """CPU work of an edge (tokenizing) in the same bounded pool as prompt preparation."""
        return await self._cpu.run(fn, *args)

    def close(self) -> None:
        self._cpu.close()

    def count_rejected(self, api: str, err: ServiceError) -> None:
        """Count a request an edge refused before it reached `generate` (auth, bad body)."""
        self._metrics.requests.labels(api, err.outcome).inc()

    async def abort(self, request_id: str, reason: str) -> bool:
        decode = self._in_flight.decode_of(request_id)
        return False if decode is None else await self._decode.abort(decode, request_id, reason)

    async def prepare(self, request: generation_pb2.GenerateRequest, request_id: str) -> PreparedRequest:
        model = self._catalog.resolve(request.model)
        # Tokenizing and templating are CPU work: off the event loop, in a bounded pool.
        prompt_ids = await self._cpu.run(model.prompts.build, request, model.max_model_len)
        param = "messages" if request.WhichOneof("input") == "chat" else "prompt"
        check_prompt_fits(len(prompt_ids), model.max_model_len, param)
        sampling = resolve_sampling(request.sampling, len(prompt_ids), model.max_model_len,
                                    model.prompts.vocab_size)
        hashes = hash_prompt_blocks(prompt_ids, model.block_size, model.block_hash_salt)
        return PreparedRequest(request_id, model, tuple(prompt_ids), tuple(hashes), sampling, request.session_id)

    async def _run(self, request: generation_pb2.GenerateRequest, request_id: str) -> AsyncIterator[generation_pb2.GenerateResponse]:
        arrival = time.monotonic()
        arrival_unix_ms = int(time.time() * 1000)
        prepared = await self.prepare(request, request_id)
        plan, stream, first = await self._open(prepared, arrival_unix_ms)
        async with contextlib.aclosing(stream):
            async for response in self._relay(first, stream, prepared, plan, arrival):
                yield response

    async def _open(self, prepared: PreparedRequest, arrival_unix_ms: int
                    ) -> tuple[RoutePlan, AsyncIterator[decode_pb2.DecodeResponse], decode_pb2.DecodeResponse]:
        """Plan and open the Decode stream up to its first message, replacing a decode
        worker that is unreachable or refuses for load (up to MAX_ATTEMPTS workers)."""
        tried: list[str] = []
        last_error: ServiceError | None = None
        while True:
            try:
                plan = self._planner.plan(prepared.request_id, prepared.model.name, len(prepared.prompt_token_ids),
                                          prepared.model.block_size, prepared.block_hashes, prepared.session_key,
                                          exclude=tried)
            except ServiceError:
                if last_error is not None:  # every worker refused: report the last refusal
                    raise last_error from None
                raise
            self._in_flight.assign(prepared.request_id, plan.decode)
            tried.append(plan.decode.worker_id)
            stream = self._decode.stream(plan.decode, _decode_request(prepared, plan, arrival_unix_ms))
            try:
                return plan, stream, await anext(stream)
            except ServiceError as err:
                if err.kind not in _RETRYABLE or len(tried) >= MAX_ATTEMPTS:
                    raise
                log.warning("request %s: decode %s refused (%s); trying another", prepared.request_id,
                            plan.decode.worker_id, err.message)
                last_error = err

    async def _relay(self, first: decode_pb2.DecodeResponse, stream: AsyncIterator[decode_pb2.DecodeResponse],
                     prepared: PreparedRequest, plan: RoutePlan, arrival: float) -> AsyncIterator[generation_pb2.GenerateResponse]:
        last_token_at = None
        message: decode_pb2.DecodeResponse | None = first
        while message is not None:
            now = time.monotonic()
            if message.token_ids:
                if last_token_at is None:
                    self._metrics.ttft.observe(now - arrival)
                else:
                    gap = (now - last_token_at) / len(message.token_ids)
                    for _ in message.token_ids:
                        self._metrics.inter_token.observe(gap)
                last_token_at = now
            response = _generate_response(prepared.request_id, message)
            if message is first:
                response.routing.CopyFrom(_routing_info(plan, len(prepared.prompt_token_ids)))
            if message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                self._metrics.e2e.observe(now - arrival)
                self._metrics.observe_finished(message)
            yield response
            message = await anext(stream, None)


def _decode_request(prepared: PreparedRequest, plan: RoutePlan, arrival_unix_ms: int) -> decode_pb2.DecodeRequest:
    prefill = decode_pb2.PrefillChoice(reason=plan.prefill_reason, queue_length=plan.prefill_queue_length)
    if plan.prefill is not None:
        prefill.worker_id, prefill.address = plan.prefill.worker_id, plan.prefill.address
    return decode_pb2.DecodeRequest(request_id=prepared.request_id, prompt_token_ids=prepared.prompt_token_ids,
                                    block_hashes=prepared.block_hashes, sampling=prepared.sampling,
                                    prefill=prefill, arrival_unix_ms=arrival_unix_ms)


def _generate_response(request_id: str, message: decode_pb2.DecodeResponse) -> generation_pb2.GenerateResponse:
    response = generation_pb2.GenerateResponse(request_id=request_id, token_ids=message.token_ids,
                                                text=message.text, logprobs=message.logprobs,
                                                finish_reason=message.finish_reason)
    for name in ("usage", "transfer", "timings"):
        if message.HasField(name):
            getattr(response, name).CopyFrom(getattr(message, name))
    return response


def _routing_info(plan: RoutePlan, num_prompt_tokens: int) -> generation_pb2.RoutingInfo:
    return generation_pb2.RoutingInfo(decode_worker_id=plan.decode.worker_id, decode_reason=plan.decode_reason,
                                      prefill_worker_id=plan.prefill.worker_id if plan.prefill else "",
                                      prefill_reason=plan.prefill_reason, num_prompt_tokens=num_prompt_tokens,
                                      num_matched_prefix_tokens=plan.num_matched_tokens)

"""One request's way through the router, shared by the HTTP and gRPC edges:

    admit (queue bound) -> resolve model -> prompt ids + block hashes -> validate sampling
    -> plan (decode, prefill) -> Decode stream -> GenerateResponse messages

A decode worker that is unreachable, or refuses for load, before sending anything is
replaced by another one (at most MAX_ATTEMPTS workers). A decode worker lost mid-stream
(dead, hung past the inactivity deadline, declared dead by the registry) hands the request
to another one, which continues after the tokens already streamed (migration). Outcomes, TTFT and inter-token
latency are recorded here.
"""
from __future__ import annotations

import contextlib
import logging
import re
import time
from dataclasses import dataclass
from typing import AsyncIterator

from pdserve.common.block_hash import INSECURE_KEY, check_cache_salt, hash_prompt_blocks
from pdserve.common.errors import EXPECTED_ERRORS, ErrorKind, ServiceError, to_service_error
from pdserve.proto.pdserve.v1 import common_pb2, decode_pb2, generation_pb2
from pdserve.router.adapters import AdapterDirectory, ServedAdapter
from pdserve.router.cpu_pool import CpuPool
from pdserve.router.admission import InFlight
from pdserve.router.catalog import ModelCatalog, ServedModel
from pdserve.router.dispatch import DecodeClient, DecodeWorkerLost
from pdserve.router.guided import GuidedOptions, compile_constraint
from pdserve.router.metrics import RouterMetrics
from pdserve.router.planner import RoutePlan, RoutePlanner
from pdserve.router.request_ids import check_label, new_request_id
from pdserve.router.stream_timings import StreamTimings
from pdserve.router.validation import check_prompt_fits, resolve_sampling
from pdserve.router.tenant_limits import TenantLimiter
from pdserve.security.client_keys import Scope
from pdserve.security.tenants import Tenant, tenant_cache_salt

log = logging.getLogger("pdserve.router.frontend")

MAX_ATTEMPTS = 3
_RETRYABLE = (ErrorKind.UNAVAILABLE, ErrorKind.RATE_LIMITED)
# GenerateResponse fields only an admin sees: worker ids, matched prefix tokens, transfer
# verdicts (whose reasons carry internal addresses) and TTFT phases (a prefix-cache timer).
INTERNAL_FIELDS = ("routing", "transfer", "timings")
_ADDRESS = re.compile(r"(?:ipv[46]:)?(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):\d{1,5}\b")  # host:port, [v6]:port
# Errors raised inside the deployment, as a client sees them: the kind and this text. Their
# own messages may name workers and their addresses; the router's log keeps them.
_CLIENT_MESSAGES = {
    ErrorKind.UNAVAILABLE: "no worker can serve this request now; try again later",
    ErrorKind.DEADLINE_EXCEEDED: "the request ran past a deadline inside the service",
    ErrorKind.INTERNAL: "internal error",
    ErrorKind.UPSTREAM_FAILED: "the prompt's prefill failed and the service is set to fail such requests",
    ErrorKind.FAILED_PRECONDITION: "the service's workers disagree on the model or its KV layout",
}


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    request_id: str
    model: ServedModel
    prompt_token_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    sampling: common_pb2.SamplingParams  # resolved
    session_key: str
    echo_text: str | None = None  # GenerateRequest.echo: the prompt's text
    cache_salt: str = ""  # what the blocks are hashed under: the request's cache_salt in its tenant's namespace
    lora_name: str = ""  # the LoRA adapter the request's model named (empty: the base model)


class Frontend:
    def __init__(self, catalog: ModelCatalog, planner: RoutePlanner, decode: DecodeClient,
                 in_flight: InFlight, metrics: RouterMetrics, cpu: CpuPool | None = None,
                 max_migrations: int = 2, guided: GuidedOptions = GuidedOptions(),
                 block_hash_key: bytes = INSECURE_KEY, limits: TenantLimiter | None = None,
                 adapters: AdapterDirectory | None = None) -> None:
        """`block_hash_key`: the deployment's (security.secret.block_hash_key), so the
        router's block hashes are the workers'. `limits`: each tenant's. `adapters`: the LoRA
        adapters the workers serve (none: a model name is a served model's or unknown)."""
        self._adapters = adapters or AdapterDirectory(None)
        self._limits = limits or TenantLimiter()
        self._catalog = catalog
        self._block_hash_key = block_hash_key
        self._guided = guided
        self._max_migrations = max_migrations
        self._cpu = cpu or CpuPool()
        self._planner = planner
        self._decode = decode
        self._in_flight = in_flight
        self._metrics = metrics

    async def generate(self, request: generation_pb2.GenerateRequest, api: str, *, request_id: str = "",
                       owner: str = "", label: str = "", scope: Scope = Scope.CLIENT,
                       tenant: Tenant | None = None) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Stream the request's GenerateResponses. Raises ServiceError (before or during the
        stream). Closing the iterator early aborts the request on its decode worker.

        `request_id` is the id every service acts on, made by the router (empty: a new one);
        `request.request_id` is never read. `label` (a client's name, checked by the edge) is
        echoed as each response's request_id; `owner` names who may `abort` it (empty: no one).
        Below `Scope.ADMIN` the responses carry no INTERNAL_FIELDS and errors are `client_error`s.
        A `tenant`'s request is held to its limits and prefix-caches in its namespace."""
        outcome = "aborted"  # unless it ends otherwise: the consumer left
        try:
            request_id = request_id or new_request_id()
            with self._limits.hold(tenant), self._in_flight.admit(request_id, owner, label):
                async with contextlib.aclosing(self._run(request, request_id, tenant)) as responses:
                    async for response in responses:
                        if response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                            outcome = "aborted" if response.finish_reason == common_pb2.FINISH_REASON_ABORT else "ok"
                        if label:
                            response.request_id = label
                        if scope < Scope.ADMIN:
                            for name in INTERNAL_FIELDS:
                                response.ClearField(name)
                            response.usage.ClearField("cached_tokens_by_tier")  # where the cache held it
                        yield response
        except EXPECTED_ERRORS as err:
            outcome = to_service_error(err).outcome
            if scope < Scope.ADMIN:
                raise client_error(err, request_id) from None
            raise
        except Exception:  # counted, then re-raised
            outcome = "error"
            raise
        finally:
            self._metrics.requests.labels(api, outcome).inc()

    async def run_cpu(self, fn, *args):
        """CPU work of an edge (tokenizing) in the same bounded pool as prompt preparation."""
        return await self._cpu.run(fn, *args)

    def close(self) -> None:
        self._cpu.close()

    def count_rejected(self, api: str, err: BaseException) -> None:
        """Count a request an edge refused before it reached `generate` (auth, bad body)."""
        self._metrics.requests.labels(api, to_service_error(err).outcome).inc()

    async def abort(self, owner: str, key: str, reason: str) -> bool:
        """Abort `owner`'s request in flight whose label or router id is `key`. Another
        owner's request is not found (False), so an Abort stops and reveals nothing of it.
        `reason` is a label (checked: it reaches the decode worker's log)."""
        reason = check_label(reason, param="reason") or "client_abort"
        request_id = self._in_flight.find(owner, key)
        decode = None if request_id is None else self._in_flight.decode_of(request_id)
        return False if decode is None else await self._decode.abort(decode, request_id, reason)

    def resolve(self, name: str) -> tuple[ServedModel, str]:
        """(the served model, the LoRA adapter or "") a request's `model` names: a served
        model's name, or an adapter's that a live worker serves (run on its parent model).
        NOT_FOUND otherwise."""
        model, adapter = self._resolve(name)
        return model, adapter.name if adapter is not None else ""

    def _resolve(self, name: str) -> tuple[ServedModel, ServedAdapter | None]:
        if name and not self._catalog.knows(name):
            adapter = self._adapters.find(name)
            if adapter is not None:
                return self._catalog.resolve(adapter.model_name), adapter
        return self._catalog.resolve(name), None

    async def prepare(self, request: generation_pb2.GenerateRequest, request_id: str,
                      tenant: Tenant | None = None) -> PreparedRequest:
        model, adapter = self._resolve(request.model)
        check_cache_salt(request.cache_salt)
        # Tokenizing and templating are CPU work: off the event loop, in a bounded pool.
        prompt_ids = await self._cpu.run(model.prompts.build, request, model.max_model_len)
        param = "messages" if request.WhichOneof("input") == "chat" else "prompt"
        check_prompt_fits(len(prompt_ids), model.max_model_len, param)
        sampling = resolve_sampling(request.sampling, len(prompt_ids), model.max_model_len,
                                    model.prompts.vocab_size)
        self._limits.charge_tokens(tenant, len(prompt_ids) + sampling.max_tokens)
        await self._cpu.run(compile_constraint, sampling, self._guided)  # checked before any worker is asked
        salt = request.cache_salt if tenant is None else tenant_cache_salt(tenant.name, request.cache_salt)
        # keyed as the workers key them, under the adapter's digest; before any worker reported
        # it, under a key no worker's cache holds (never the base model's)
        lora_key = "" if adapter is None else adapter.digest or f"unreported:{adapter.name}"
        hashes = hash_prompt_blocks(prompt_ids, model.block_size, model.block_hash_salt, self._block_hash_key, salt,
                                    lora_key)
        echo_text = await self._cpu.run(model.prompts.echo_text, request, prompt_ids) if request.echo else None
        return PreparedRequest(request_id, model, tuple(prompt_ids), tuple(hashes), sampling, request.session_id,
                               echo_text, salt, adapter.name if adapter is not None else "")

    async def _run(self, request: generation_pb2.GenerateRequest, request_id: str,
                   tenant: Tenant | None = None) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Prepare, open a Decode stream, relay it. When the decode worker is lost mid-stream
        the request migrates: another decode continues it after the tokens already sent (at
        most `max_migrations` times); otherwise the error ends the stream."""
        arrival = time.monotonic()
        arrival_unix_ms = int(time.time() * 1000)
        prepared = await self.prepare(request, request_id, tenant)
        sent: list[int] = []  # token ids the client has received
        failed: list[str] = []  # decode workers lost by this request
        timings = StreamTimings()
        while True:
            timings.opening()
            plan, stream, first = await self._open(prepared, arrival_unix_ms, sent, failed)
            try:
                async with contextlib.aclosing(stream):
                    async for response in self._relay(first, stream, prepared, plan, arrival, timings, failed):
                        sent.extend(response.token_ids)
                        yield response
                return
            except DecodeWorkerLost as err:
                failed.append(plan.decode.worker_id)
                if not self._may_migrate(prepared, len(failed), len(sent)):
                    raise
                timings.lost()
                log.warning("request %s: %s; migrating it after %d tokens (migration %d of %d)", request_id,
                            err.message, len(sent), len(failed), self._max_migrations)

    def _may_migrate(self, prepared: PreparedRequest, num_lost: int, num_sent: int) -> bool:
        if num_lost > self._max_migrations:
            self._metrics.migrations.labels("limit").inc()
            return False
        if num_sent >= prepared.sampling.max_tokens:
            return False  # nothing left to generate: the finish message alone was lost
        self._metrics.migrations.labels("migrated").inc()
        return True

    async def _open(self, prepared: PreparedRequest, arrival_unix_ms: int, resumed: list[int], lost: list[str]
                    ) -> tuple[RoutePlan, AsyncIterator[decode_pb2.DecodeResponse], decode_pb2.DecodeResponse]:
        """Plan and open the Decode stream up to its first message, replacing a decode
        worker that is unreachable or refuses for load (up to MAX_ATTEMPTS workers). A
        migrated request (`resumed` tokens sent, workers `lost`) avoids the lost workers and
        prefills locally."""
        tried: list[str] = list(lost)
        last_error: ServiceError | None = None
        while True:
            try:
                plan = self._planner.plan(prepared.request_id, prepared.model.name, len(prepared.prompt_token_ids),
                                          prepared.model.block_size, prepared.block_hashes, prepared.session_key,
                                          exclude=tried, migrated=bool(lost), lora_name=prepared.lora_name)
            except EXPECTED_ERRORS:
                if last_error is not None:  # every worker refused: report the last refusal
                    raise last_error from None
                raise
            self._in_flight.assign(prepared.request_id, plan.decode)
            tried.append(plan.decode.worker_id)
            stream = self._decode.stream(plan.decode, _decode_request(prepared, plan, arrival_unix_ms, resumed))
            try:
                return plan, stream, await anext(stream)
            except EXPECTED_ERRORS as raised:
                err = to_service_error(raised)
                retryable = err.kind in _RETRYABLE or isinstance(err, DecodeWorkerLost)
                if not retryable or len(tried) - len(lost) >= MAX_ATTEMPTS:
                    raise
                log.warning("request %s: decode %s refused (%s); trying another", prepared.request_id,
                            plan.decode.worker_id, err.message)
                last_error = err

    async def _relay(self, first: decode_pb2.DecodeResponse, stream: AsyncIterator[decode_pb2.DecodeResponse],
                     prepared: PreparedRequest, plan: RoutePlan, arrival: float,
                     timings: StreamTimings, lost: list[str]) -> AsyncIterator[generation_pb2.GenerateResponse]:
        last_token_at = timings.last_token_at  # TTFT: once per request; a migration's stall is one gap
        message: decode_pb2.DecodeResponse | None = first
        while message is not None:
            timings.relayed(message)
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
            if message is first and not lost:  # the routing of the request's first stream
                response.routing.CopyFrom(_routing_info(plan, len(prepared.prompt_token_ids)))
                _add_prompt(response, prepared)
            if message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                self._metrics.e2e.observe(now - arrival)
                self._metrics.observe_finished(message)
            yield response
            message = await anext(stream, None)


def client_error(err: BaseException, request_id: str) -> ServiceError:
    """`err` as a caller below Scope.ADMIN sees it: an error of the request itself keeps its
    message, less any host:port in it; one raised inside the deployment says only its kind.
    What was withheld is logged under `request_id`."""
    service_error = to_service_error(err)
    public = _CLIENT_MESSAGES.get(service_error.kind)
    if public is None:
        public = _ADDRESS.sub("<internal address>", service_error.message)  # a net under the rule above
        if public == service_error.message:
            return service_error
    log.info("request %s: %s (the client sees: %s)", request_id, service_error.message, public)
    return ServiceError(service_error.kind, public, param=service_error.param, code=service_error.code,
                        retry_after_s=service_error.retry_after_s)


def _add_prompt(response: generation_pb2.GenerateResponse, prepared: PreparedRequest) -> None:
    """echo and prompt logprobs: the request's first message names the prompt."""
    if prepared.echo_text is not None or prepared.sampling.HasField("prompt_logprobs"):
        response.prompt_token_ids.extend(prepared.prompt_token_ids)
    if prepared.echo_text is not None:
        response.prompt_text = prepared.echo_text


def _decode_request(prepared: PreparedRequest, plan: RoutePlan, arrival_unix_ms: int,
                    resumed: list[int]) -> decode_pb2.DecodeRequest:
    prefill = decode_pb2.PrefillChoice(reason=plan.prefill_reason, queue_length=plan.prefill_queue_length)
    if plan.prefill is not None:
        prefill.worker_id, prefill.address = plan.prefill.worker_id, plan.prefill.address
    request = decode_pb2.DecodeRequest(request_id=prepared.request_id, prompt_token_ids=prepared.prompt_token_ids,
                                       block_hashes=prepared.block_hashes, sampling=prepared.sampling,
                                       prefill=prefill, arrival_unix_ms=arrival_unix_ms,
                                       resumed_token_ids=resumed, cache_salt=prepared.cache_salt,
                                       lora_name=prepared.lora_name)
    if resumed:  # the client has the prompt's logprobs from the first decode
        request.sampling.ClearField("prompt_logprobs")
    return request


def _generate_response(request_id: str, message: decode_pb2.DecodeResponse) -> generation_pb2.GenerateResponse:
    response = generation_pb2.GenerateResponse(request_id=request_id, token_ids=message.token_ids,
                                                text=message.text, logprobs=message.logprobs,
                                                finish_reason=message.finish_reason,
                                                prompt_logprobs=message.prompt_logprobs)
    for name in ("usage", "transfer", "timings"):
        if message.HasField(name):
            getattr(response, name).CopyFrom(getattr(message, name))
    return response


def _routing_info(plan: RoutePlan, num_prompt_tokens: int) -> generation_pb2.RoutingInfo:
    info = generation_pb2.RoutingInfo(decode_worker_id=plan.decode.worker_id, decode_reason=plan.decode_reason,
                                      prefill_worker_id=plan.prefill.worker_id if plan.prefill else "",
                                      prefill_reason=plan.prefill_reason, num_prompt_tokens=num_prompt_tokens,
                                      num_matched_prefix_tokens=plan.num_matched_tokens)
    if plan.prediction is not None and plan.prediction.measured:
        info.predicted_local_s = plan.prediction.local_s + plan.prediction.stall_s
        info.predicted_remote_s = plan.prediction.remote_s
        info.predicted_transfer_s = plan.prediction.transfer_s
    return info

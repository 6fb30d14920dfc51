"""Pick the decode worker, then (unless decode should prefill locally) the prefill worker.

Conditional disaggregation: after choosing decode D, the uncached part of the prompt is
`num_prompt_tokens - matched_blocks(D) * block_size`; at or under the local-prefill
threshold no prefill worker is proposed (reason "short_uncached_prompt"), nor when no
prefill worker is alive ("no_prefill_worker"), nor when the chosen one's queue is at or
over the prefill-queue threshold ("prefill_queue_long"), nor when no live prefill worker
shares a usable KV backend with D by their last reports ("no_usable_kv_backend": every
backend down would mean computing the prompt twice). This is the only place that
decides local vs remote; decode follows it unless it cannot receive KV at all. Every decision is logged and counted in
pdserve_router_routing_decisions_total{pool, policy, reason}.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Collection, Sequence

from pdserve.common.errors import UnavailableError
from pdserve.router.config import Role
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import RouteQuery, RoutingPolicy
from pdserve.router.worker_registry import Worker, WorkerRecord, WorkerRegistry

log = logging.getLogger("pdserve.router.planner")

SHORT_UNCACHED_PROMPT = "short_uncached_prompt"
NO_PREFILL_WORKER = "no_prefill_worker"
PREFILL_QUEUE_LONG = "prefill_queue_long"
NO_USABLE_KV_BACKEND = "no_usable_kv_backend"
MIGRATED = "migrated"  # a request continued after its decode was lost: decode recomputes it


@dataclass(frozen=True, slots=True)
class RoutePlan:
    decode: Worker
    decode_reason: str
    prefill: Worker | None  # None: decode prefills locally
    prefill_reason: str
    prefill_queue_length: int  # the prefill worker's last reported queue (0 if local)
    num_matched_tokens: int  # prompt tokens the router believes cached on decode


class RoutePlanner:
    def __init__(self, registry: WorkerRegistry, decode_policy: RoutingPolicy, prefill_policy: RoutingPolicy,
                 local_prefill_threshold: int, prefill_queue_threshold: int,
                 metrics: RouterMetrics) -> None:
        self._registry = registry
        self._decode_policy = decode_policy
        self._prefill_policy = prefill_policy
        self._threshold = local_prefill_threshold
        self._queue_threshold = prefill_queue_threshold
        self._metrics = metrics

    def plan(self, request_id: str, model_name: str, num_prompt_tokens: int, block_size: int,
             block_hashes: Sequence[int], session_key: str, exclude: Collection[str] = (),
             migrated: bool = False) -> RoutePlan:
        """UNAVAILABLE when no decode worker of the model is routable (minus `exclude`).
        A `migrated` request gets no prefill worker (its resumed tokens are prefilled too)."""
        query = RouteQuery(tuple(block_hashes), session_key, num_prompt_tokens, block_size)
        decoders = [r for r in self._registry.routable(Role.DECODE, model_name) if r.worker_id not in exclude]
        if not decoders:
            raise UnavailableError(f"no decode worker is available for model {model_name!r}",
                                   retry_after_s=1)
        decode = self._decode_policy.choose(decoders, query)
        self._count("decode", self._decode_policy.name, decode.reason)
        num_matched = min(decode.record.num_matched_blocks(block_hashes) * block_size, num_prompt_tokens)

        prefill, prefill_reason, queue_length = None, "", 0
        prefillers = self._registry.routable(Role.PREFILL, model_name)
        if migrated:
            prefill_reason = MIGRATED
        elif num_prompt_tokens - num_matched <= self._threshold:
            prefill_reason = SHORT_UNCACHED_PROMPT
        elif not prefillers:
            prefill_reason = NO_PREFILL_WORKER
        elif not (prefillers := [r for r in prefillers if can_carry(r, decode.record)]):
            prefill_reason = NO_USABLE_KV_BACKEND
        else:
            choice = self._prefill_policy.choose(prefillers, query)
            queue_length = choice.record.load.num_queued
            if queue_length >= self._queue_threshold:
                prefill_reason, queue_length = PREFILL_QUEUE_LONG, 0
            else:
                prefill, prefill_reason = choice.record.worker, choice.reason
                self._registry.note_routed(choice.record.worker_id, block_hashes)
        self._count("prefill", self._prefill_policy.name, prefill_reason)
        self._registry.note_routed(decode.record.worker_id, block_hashes)
        log.info("route %s: decode=%s (%s) prefill=%s (%s) prompt=%d matched=%d", request_id,
                 decode.record.worker_id, decode.reason, prefill.worker_id if prefill else "local",
                 prefill_reason, num_prompt_tokens, num_matched)
        return RoutePlan(decode.record.worker, decode.reason, prefill, prefill_reason, queue_length, num_matched)

    def _count(self, pool: str, policy: str, reason: str) -> None:
        self._metrics.routing.labels(pool, policy, reason).inc()


def can_carry(prefill: WorkerRecord, decode: WorkerRecord) -> bool:
    """Whether a KV backend both workers speak is usable on both (by their last reports; a
    backend in its cool-down is reported usable once a probe is due, so traffic brings it back).
    A worker that names no backends (registered by hand) is taken at its word."""
    if not prefill.worker.kv_backends or not decode.worker.kv_backends:
        return True
    return bool((prefill.usable_backends() & decode.usable_backends()) - {"recompute"})

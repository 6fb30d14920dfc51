"""Pick the decode worker, then (unless decode should prefill locally) the prefill worker.

Conditional disaggregation: after choosing decode D, the uncached part of the prompt is
`num_prompt_tokens - matched_blocks(D) * block_size`; at or under the local-prefill
threshold no prefill worker is proposed (reason "short_uncached_prompt"), nor when no
prefill worker is alive ("no_prefill_worker"), nor when the chosen one's queue is at or
over the prefill-queue threshold ("prefill_queue_long"), nor when no live prefill worker
shares a usable KV backend with D by their last reports ("no_usable_kv_backend": every
backend down would mean computing the prompt twice). Between those bounds the path with
the shorter predicted time to first token wins (`predict_ttft`: each side's queued prompt
tokens and the ones it must compute over its measured prefill rate (the prefill worker
computes what its own cache lacks, not only what the decode's lacks), plus the transfer on the remote side, plus on the
local side the stall its compute costs the streams decoding there; before either side has
measured a rate, by queued tokens alone, as both run the same model): when 8 prompts arrive at once
the decode takes its share instead of idling while one prefill worker queues them all
("predicted_faster_local"); an idle prefill worker keeps every prompt. A link whose cost alone
keeps a prompt local gets it anyway once its measurement is older than the probe interval, one
prompt per interval ("link_probe", `LinkProbes`): only a transfer re-measures a link. This is the
only place that decides local vs remote; decode follows it unless it cannot receive KV at all.
Every decision is logged and counted in pdserve_router_routing_decisions_total{pool, policy, reason}.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Collection, Sequence

from pdserve.common.errors import UnavailableError
from pdserve.router.config import Role
from pdserve.router.link_probes import LinkProbes
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import RouteQuery, RoutingPolicy, adapter_candidates
from pdserve.router.worker_registry import Worker, WorkerRecord, WorkerRegistry

log = logging.getLogger("pdserve.router.planner")

SHORT_UNCACHED_PROMPT = "short_uncached_prompt"
NO_PREFILL_WORKER = "no_prefill_worker"
PREFILL_QUEUE_LONG = "prefill_queue_long"
NO_USABLE_KV_BACKEND = "no_usable_kv_backend"
PREDICTED_FASTER_LOCAL = "predicted_faster_local"
LINK_PROBE = "link_probe"  # remote although predicted slower: the link's measurement aged out
MIGRATED = "migrated"  # a request continued after its decode was lost: decode recomputes it

# The prefill rate assumed on both sides before either has measured one: any positive value
# ranks the two paths the same (by queued tokens); the logged seconds are not a forecast then.
UNMEASURED_TOKENS_PER_S = 1000.0


@dataclass(frozen=True, slots=True)
class RoutePlan:
    decode: Worker
    decode_reason: str
    prefill: Worker | None  # None: decode prefills locally
    prefill_reason: str
    prefill_queue_length: int  # the prefill worker's last reported queue (0 if local)
    num_matched_tokens: int  # prompt tokens the router believes cached on decode
    prediction: TTFTPrediction | None = None  # when both paths were open and both had rates


@dataclass(frozen=True, slots=True)
class TTFTPrediction:
    """Predicted seconds to a prompt's first token, prefilled on decode or on a prefill worker,
    and the seconds a local prefill would stall the decode's running streams."""

    local_s: float
    remote_s: float  # transfer_s included
    stall_s: float  # the local prefill's own compute: every stream decoding there waits it out
    num_stalled: int = 1  # those streams, at least one (logged: how many a local prefill pauses)
    measured: bool = True  # False: no rate measured yet, the seconds only rank the two paths
    transfer_s: float = 0.0  # the remote side's KV transfer, past its forward (`transfer_cost`)

    @property
    def local_faster(self) -> bool:
        """Local wins only when its first token comes sooner even after the stall it costs
        the decode's streams, charged once: they all wait the same `stall_s` side by side, a
        pause of one inter-token gap each (0.6 s spread over 64 tokens is ~10 ms of TPOT),
        where the prompt waiting for a prefill worker loses its whole wait from its TTFT.
        An idle prefill worker keeps every prompt (that is what disaggregation is for) and a
        burst on an idle decode is shared half and half. Charging the stall once per stream
        would keep a busy decode's core idle behind a prefill queue."""
        return self.local_s + self.stall_s < self.remote_s

    @property
    def link_decided(self) -> bool:
        """Local wins only by the link's cost: without `transfer_s` the remote side would."""
        return self.local_faster and self.local_s + self.stall_s >= self.remote_s - self.transfer_s


def predict_ttft(prefill: WorkerRecord, decode: WorkerRecord, num_tokens: int,
                 block_size: int = 16, remote_tokens: int | None = None) -> TTFTPrediction | None:
    """Each side: the prompt tokens queued ahead of the ones it must compute, and those, at
    its recent prefill rate. The decode computes `num_tokens` (what it lacks); the prefill
    worker `remote_tokens` (what it lacks: a prefix only the decode holds, such as a chat's
    history with its answers, is computed there again; default `num_tokens`) and sends the
    decode's `num_tokens` worth of blocks; the remote side adds the KV transfer this pair's link costs past the
    forward (`transfer_cost`), the local side the time its own compute holds up each of the
    decode's decoding streams (`stall_s`, `num_stalled`, by its last report).
    A side that has not prefilled yet is taken to prefill at the other's rate (same model; its
    own rate replaces the guess after its first prompt), and before either has, at a stand-in
    rate (`measured` False): the first burst after start is then split by queued tokens
    instead of queueing whole on one prefill worker while the decode idles (8 prompts at
    once: the last first token came after 4.9 s, every prompt on the prefill worker's core)."""
    remote_rate = prefill.load.prefill_tokens_per_s or decode.load.prefill_tokens_per_s
    measured = remote_rate > 0
    if not measured:
        remote_rate = UNMEASURED_TOKENS_PER_S
    local_rate = decode.load.prefill_tokens_per_s or remote_rate
    compute = (num_tokens if remote_tokens is None else remote_tokens) / remote_rate
    transfer = transfer_cost(decode, prefill.worker_id, -(-num_tokens // block_size), compute)
    remote = prefill.queued_prompt_tokens() / remote_rate + compute + transfer
    local = (decode.queued_prompt_tokens() + num_tokens) / local_rate
    return TTFTPrediction(local_s=local, remote_s=remote, stall_s=num_tokens / local_rate,
                          num_stalled=max(1, decode.load.num_decoding), measured=measured, transfer_s=transfer)


def remote_work(prefill: WorkerRecord, query: RouteQuery, uncached: int) -> int:
    """Prompt tokens `prefill` computes for a hand-off of `uncached` tokens: the prompt less
    the leading blocks its own cache holds (by its KV events), never fewer than `uncached`."""
    held = len(prefill.kv.leading_tiers(query.block_hashes)) * query.block_size
    return max(uncached, query.num_prompt_tokens - held)


def transfer_cost(decode: WorkerRecord, prefill_id: str, num_blocks: int, compute_s: float) -> float:
    """Seconds the KV of `num_blocks` from `prefill_id` adds past that worker's forward of
    `compute_s`, by what the decode has received from it lately (`EngineCounters.received`):
    the larger of its recent tail and the time the link needs for those bytes beyond the forward
    (a stream sent while the forward runs hides at most the forward). 0 before any transfer
    from that worker: the link is unknown, and only a transfer measures it."""
    counters = decode.load.counters
    if counters is None:
        return 0.0
    for link in counters.received:
        if link.peer == prefill_id and link.transfers and link.bytes_per_s > 0:
            return max(link.tail_s, num_blocks * link.bytes_per_block / link.bytes_per_s - compute_s)
    return 0.0


class RoutePlanner:
    def __init__(self, registry: WorkerRegistry, decode_policy: RoutingPolicy, prefill_policy: RoutingPolicy,
                 local_prefill_threshold: int, prefill_queue_threshold: int,
                 metrics: RouterMetrics, predict: bool = True, probes: LinkProbes | None = None) -> None:
        """`predict`: between the thresholds, route by predicted time to first token (else
        always to a prefill worker). `probes`: when a link priced out of use is tried again
        (default: never; the router passes --link-probe-interval-s)."""
        self._registry = registry
        self._decode_policy = decode_policy
        self._prefill_policy = prefill_policy
        self._threshold = local_prefill_threshold
        self._queue_threshold = prefill_queue_threshold
        self._metrics = metrics
        self._predict = predict
        self._probes = probes or LinkProbes(0)

    def plan(self, request_id: str, model_name: str, num_prompt_tokens: int, block_size: int,
             block_hashes: Sequence[int], session_key: str, exclude: Collection[str] = (),
             migrated: bool = False, lora_name: str = "") -> RoutePlan:
        """UNAVAILABLE when no decode worker of the model is routable (minus `exclude`), or
        none serves the LoRA adapter `lora_name`. A `migrated` request gets no prefill worker
        (its resumed tokens are prefilled too). Under an adapter, workers holding it are
        preferred while load allows (`adapter_candidates`) on both sides."""
        query = RouteQuery(tuple(block_hashes), session_key, num_prompt_tokens, block_size)
        decoders = [r for r in self._registry.routable(Role.DECODE, model_name) if r.worker_id not in exclude]
        decoders, lora_reason = adapter_candidates(decoders, lora_name)
        if not decoders:
            raise UnavailableError(f"no decode worker is available for model {model_name!r}"
                                   + (f" with adapter {lora_name!r}" if lora_name else ""), retry_after_s=1)
        decode = self._decode_policy.choose(decoders, query)
        if lora_reason:
            self._count("decode", "lora", lora_reason)
        self._count("decode", self._decode_policy.name, decode.reason)
        tiers = decode.record.kv.leading_tiers(block_hashes)
        num_matched = min(len(tiers) * block_size, num_prompt_tokens)
        self._metrics.count_matched_prefix(tiers, block_size, num_matched)
        uncached = num_prompt_tokens - num_matched
        if migrated:
            pick = _PrefillPick(None, MIGRATED)
        else:
            pick = self._pick_prefill(model_name, query, decode.record, uncached, lora_name)
        prefill = pick.record.worker if pick.record is not None else None
        if prefill is not None:
            self._registry.note_routed(prefill.worker_id, prompt_tokens=pick.remote_tokens, block_hashes=block_hashes)
        self._count("prefill", self._prefill_policy.name, pick.reason)
        self._registry.note_routed(decode.record.worker_id, prompt_tokens=0 if prefill else max(0, uncached),
                                   block_hashes=block_hashes)
        log.info("route %s: decode=%s (%s) prefill=%s (%s) prompt=%d matched=%d%s%s", request_id,
                 decode.record.worker_id, decode.reason, prefill.worker_id if prefill else "local",
                 pick.reason, num_prompt_tokens, num_matched, _describe(pick.prediction),
                 f"; link {prefill.worker_id}->{decode.record.worker_id} last measured {pick.link_age_s:.0f} s "
                 f"ago: this prompt probes it" if pick.reason == LINK_PROBE else "")
        return RoutePlan(decode.record.worker, decode.reason, prefill, pick.reason,
                         pick.record.load.num_queued if prefill else 0, num_matched, pick.prediction)

    def _pick_prefill(self, model_name: str, query: RouteQuery, decode: WorkerRecord,
                      uncached: int, lora_name: str = "") -> _PrefillPick:
        """The prefill worker for `uncached` prompt tokens, or none and why (the module's rules)."""
        prefillers, _ = adapter_candidates(self._registry.routable(Role.PREFILL, model_name), lora_name)
        if uncached <= self._threshold:
            return _PrefillPick(None, SHORT_UNCACHED_PROMPT)
        if not prefillers:
            return _PrefillPick(None, NO_PREFILL_WORKER)
        if not (prefillers := [r for r in prefillers if can_carry(r, decode)]):
            return _PrefillPick(None, NO_USABLE_KV_BACKEND)
        choice = self._prefill_policy.choose(prefillers, query)
        work = remote_work(choice.record, query, uncached)
        prediction = (predict_ttft(choice.record, decode, uncached, query.block_size, work)
                      if self._predict else None)
        if choice.record.load.num_queued >= self._queue_threshold:
            return _PrefillPick(None, PREFILL_QUEUE_LONG, prediction)
        if prediction is None or not prediction.local_faster:
            return _PrefillPick(choice.record, choice.reason, prediction, remote_tokens=work)
        age_s = self._probes.try_probe(decode, choice.record.worker_id) if prediction.link_decided else None
        if age_s is None:
            return _PrefillPick(None, PREDICTED_FASTER_LOCAL, prediction)
        return _PrefillPick(choice.record, LINK_PROBE, prediction, age_s, remote_tokens=work)

    def _count(self, pool: str, policy: str, reason: str) -> None:
        self._metrics.routing.labels(pool, policy, reason).inc()


@dataclass(frozen=True, slots=True)
class _PrefillPick:
    record: WorkerRecord | None  # None: decode prefills locally
    reason: str
    prediction: TTFTPrediction | None = None
    link_age_s: float = 0.0  # LINK_PROBE: seconds since the link was last measured
    remote_tokens: int = 0  # prompt tokens the prefill worker computes (`remote_work`)


def _describe(prediction: TTFTPrediction | None) -> str:
    """The log's account of a prediction (empty without one)."""
    if prediction is None:
        return ""
    return (f" predicted TTFT local {prediction.local_s:.2f} s (+{prediction.stall_s:.2f} s stall of "
            f"{prediction.num_stalled} streams), "
            f"remote {prediction.remote_s:.2f} s (transfer {prediction.transfer_s:.2f} s)"
            f"{'' if prediction.measured else ' (no measured rate yet: by queued tokens)'}")


def can_carry(prefill: WorkerRecord, decode: WorkerRecord) -> bool:
    """Whether a KV backend both workers speak is usable on both (by their last reports; a
    backend in its cool-down is reported usable once a probe is due, so traffic brings it back).
    A worker that names no backends (registered by hand) is taken at its word."""
    if not prefill.worker.kv_backends or not decode.worker.kv_backends:
        return True
    return bool((prefill.usable_backends() & decode.usable_backends()) - {"recompute"})

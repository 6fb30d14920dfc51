"""The router's Prometheus metrics, on a registry of its own (never the global default)."""
from __future__ import annotations

import re
from typing import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdserve.proto.pdserve.v1 import common_pb2, decode_pb2
from pdserve.router.worker_registry import WorkerRegistry

MAX_BACKEND_LABELS = 16
_PLAIN = re.compile(r"[a-z0-9_]{1,32}")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, workers: WorkerRegistry | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        if workers is not None:
            r.register(WorkerEngineMetrics(workers))
        self.requests = Counter("pdserve_router_requests_total", "Requests by API and outcome",
                                ("api", "outcome"), registry=r)
        self.ttft = Histogram("pdserve_router_ttft_seconds", "Arrival at the router to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_phase = Histogram("pdserve_router_ttft_phase_seconds",
                                    "TTFT split as measured by decode (queue, prefill, transfer, first_decode)",
                                    ("phase",), buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("pdserve_router_inter_token_latency_seconds",
                                     "Time between streamed tokens", buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_router_request_latency_seconds", "Arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.routing = Counter("pdserve_router_routing_decisions_total", "Routing decisions by pool, policy and reason",
                               ("pool", "policy", "reason"), registry=r)
        self.transfers = Counter("pdserve_router_transfer_outcomes_total",
                                 "Final KV hand-off verdicts of finished requests", ("outcome", "backend"), registry=r)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens_total",
                                     "Prompt tokens of finished requests, cached or computed", ("kind",), registry=r)
        self.matched_prefix_tokens = Counter(
            "pdserve_router_matched_prefix_tokens_total",
            "Prompt tokens routed to a decode whose KV events say it holds them, by the nearest tier holding "
            "each block (device, host, disk, redis): what the router expected cached", ("tier",), registry=r)
        self.cached_tokens_by_tier = Counter(
            "pdserve_router_cached_prompt_tokens_by_tier_total", "Cached prompt tokens of finished requests by "
            "where they were found: device (a worker's KV pool), host, disk, redis", ("tier",), registry=r)
        self.completion_tokens = Counter("pdserve_router_completion_tokens_total", "Generated tokens", registry=r)
        self.draft_tokens = Counter("pdserve_router_draft_tokens_total",
                                    "Speculative drafts checked by decode, accepted or rejected (acceptance rate: "
                                    "accepted / all)", ("outcome",), registry=r)
        self.draft_steps = Counter("pdserve_router_draft_steps_total",
                                   "Decode steps that checked drafts; tokens per such step: (accepted drafts + "
                                   "steps) / steps", registry=r)
        self.migrations = Counter("pdserve_router_migrations_total",
                                  "Requests whose decode worker was lost mid-stream, by what followed "
                                  "(migrated to another decode, or ended: limit reached)", ("outcome",), registry=r)
        self.in_flight = Gauge("pdserve_router_in_flight_requests", "Requests admitted and not finished", registry=r)
        self.workers = Gauge("pdserve_router_workers", "Known workers by role and state (alive, draining, suspect, "
                             "dead)", ("role", "state"), registry=r)
        self._backend_labels: set[str] = set()
        self.auth_refused = Counter("pdserve_router_auth_refused_total",
                                    "Registry calls refused for want of a valid credential", ("reason",), registry=r)

    def _backend_label(self, name: str) -> str:
        """A decode's word for a backend as a label: a plain name, and at most
        MAX_BACKEND_LABELS of them ever ("other" past that), so no worker can grow the series."""
        if name in self._backend_labels:
            return name
        if len(self._backend_labels) >= MAX_BACKEND_LABELS or not _PLAIN.fullmatch(name):
            return "other"
        self._backend_labels.add(name)
        return name

    def count_matched_prefix(self, tiers: Sequence[str], block_size: int, num_matched: int) -> None:
        """`tiers`: the nearest tier of each leading block a decode was routed for; the last
        block may be partly prompt (`num_matched` caps the tokens)."""
        left = num_matched
        for tier in tiers:
            tokens = min(block_size, left)
            if tokens <= 0:
                return
            self.matched_prefix_tokens.labels(tier).inc(tokens)
            left -= tokens

    def count_auth_refusal(self, reason: str) -> None:
        self.auth_refused.labels(reason).inc()

    def observe_finished(self, last: decode_pb2.DecodeResponse) -> None:
        """Record what the last message of a Decode stream reports (fields it carries)."""
        if last.HasField("transfer"):
            verdict = last.transfer
            outcome = common_pb2.TransferOutcome.Name(verdict.outcome).removeprefix("TRANSFER_OUTCOME_").lower()
            self.transfers.labels(outcome, self._backend_label(verdict.backend or "none")).inc()
        if last.HasField("usage"):
            usage = last.usage
            self.prompt_tokens.labels("cached").inc(usage.cached_prompt_tokens)
            self.prompt_tokens.labels("computed").inc(max(0, usage.prompt_tokens - usage.cached_prompt_tokens))
            for tier, tokens in usage.cached_tokens_by_tier.items():
                self.cached_tokens_by_tier.labels(tier).inc(tokens)
            self.completion_tokens.inc(usage.completion_tokens)
            if usage.draft_steps:
                self.draft_tokens.labels("accepted").inc(usage.accepted_draft_tokens)
                self.draft_tokens.labels("rejected").inc(usage.rejected_draft_tokens)
                self.draft_steps.inc(usage.draft_steps)
        if last.HasField("timings"):
            timings = last.timings
            for phase, ms in (("queue", timings.queue_ms), ("prefill", timings.prefill_ms),
                              ("transfer", timings.transfer_ms), ("first_decode", timings.first_decode_ms)):
                self.ttft_phase.labels(phase).observe(ms / 1000.0)

    def render(self, registry_view: WorkerRegistry) -> bytes:
        """The exposition text, with worker gauges refreshed from the registry."""
        self.workers.clear()
        for record in registry_view.records():
            alive = registry_view.is_alive(record)
            state = "dead" if not alive else ("suspect" if record.suspect else (
                "draining" if record.load.draining else "alive"))
            self.workers.labels(record.worker.role.value, state).inc()
        return generate_latest(self.registry)


class WorkerEngineMetrics:
    """Each live worker's engine and transfer numbers, from its last heartbeat, labelled by
    worker: one /metrics shows the whole deployment. Names follow vLLM's where it has one
    (`vllm:num_requests_running` -> `pdserve:num_requests_running`)."""

    _LABELS = ("worker_id", "role", "model_name")

    def __init__(self, workers: WorkerRegistry) -> None:
        self._workers = workers

    def describe(self):
        return []  # families are built per scrape

    def collect(self):
        g = lambda name, text: GaugeMetricFamily(name, text, labels=self._LABELS)  # noqa: E731
        c = lambda name, text, extra=(): CounterMetricFamily(name, text, labels=(*self._LABELS, *extra))  # noqa: E731
        running = g("pdserve:num_requests_running", "Requests running on the worker's engine")
        waiting = g("pdserve:num_requests_waiting", "Requests waiting for admission or compute")
        usage = g("pdserve:kv_cache_usage_perc", "Share of the KV cache in use (0-1)")
        rate = g("pdserve:prefill_tokens_per_s", "Prompt tokens computed per second of forward time, recently "
                 "(absent: none measured yet)")
        prompt = c("pdserve:prompt_tokens", "Prompt tokens run through the model")
        generation = c("pdserve:generation_tokens", "Tokens generated")
        queries = c("pdserve:prefix_cache_queries", "Prompt tokens of admitted requests")
        hits = c("pdserve:prefix_cache_hits", "Prompt tokens the prefix cache held")
        preemptions = c("pdserve:num_preemptions", "Requests preempted for KV space")
        steps = c("pdserve:engine_steps", "Engine steps that ran a forward")
        step_seconds = c("pdserve:engine_step_seconds", "Time in engine steps that ran a forward")
        transfers = c("pdserve:kv_transfers", "KV transfers carried, by backend (sender side)", ("backend",))
        transfer_bytes = c("pdserve:kv_transfer_bytes", "KV bytes carried, by backend", ("backend",))
        transfer_seconds = c("pdserve:kv_transfer_seconds", "Time of the transfers carried, by backend", ("backend",))
        failures = c("pdserve:kv_transfer_failures", "Transfer steps that failed, by backend", ("backend",))
        usable = GaugeMetricFamily("pdserve_router_kv_backend_usable", "1 while a live worker reports a KV "
                                   "transfer backend usable, 0 while it skips it", labels=("worker_id", "backend"))
        indexed = GaugeMetricFamily("pdserve_router_kv_index_blocks", "Blocks the router's index says a live "
                                    "worker holds, by tier (from its KV events)", labels=("worker_id", "tier"))
        families = (running, waiting, usage, rate, prompt, generation, queries, hits, preemptions, steps, step_seconds,
                    transfers, transfer_bytes, transfer_seconds, failures, usable, indexed)
        for record in self._workers.alive():
            labels = (record.worker_id, record.worker.role.value, record.worker.model_name)
            load = record.load
            for backend in load.kv_backends:
                usable.add_metric((record.worker_id, backend.name), 1 if backend.usable else 0)
            for tier, held in record.kv.tiers.items():
                indexed.add_metric((record.worker_id, tier), len(held))
            running.add_metric(labels, load.num_running)
            waiting.add_metric(labels, load.num_queued)
            if load.num_total_blocks:
                usage.add_metric(labels, 1 - load.num_free_blocks / load.num_total_blocks)
            if load.prefill_tokens_per_s:
                rate.add_metric(labels, load.prefill_tokens_per_s)
            n = load.counters
            if n is None:
                continue
            for family, value in ((prompt, n.prompt_tokens_computed), (generation, n.generation_tokens),
                                  (queries, n.prefix_cache_queries), (hits, n.prefix_cache_hits),
                                  (preemptions, n.preemptions), (steps, n.steps), (step_seconds, n.step_seconds)):
                family.add_metric(labels, value)
            for t in n.transfers:
                for family, value in ((transfers, t.transfers), (transfer_bytes, t.bytes),
                                      (transfer_seconds, t.seconds), (failures, t.failures)):
                    family.add_metric((*labels, t.backend), value)
        yield from families

"""The router's Prometheus metrics, on a registry of its own (never the global default)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdserve.proto.pdserve.v1 import common_pb2, decode_pb2
from pdserve.router.registry import WorkerRegistry

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
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
        self.completion_tokens = Counter("pdserve_router_completion_tokens_total", "Generated tokens", registry=r)
        self.migrations = Counter("pdserve_router_migrations_total",
                                  "Requests whose decode worker was lost mid-stream, by what followed "
                                  "(migrated to another decode, or ended: limit reached)", ("outcome",), registry=r)
        self.in_flight = Gauge("pdserve_router_in_flight_requests", "Requests admitted and not finished", registry=r)
        self.kv_backends = Gauge("pdserve_router_kv_backend_usable", "1 while a live worker reports a KV "
                                 "transfer backend usable, 0 while it skips it", ["worker_id", "backend"],
                                 registry=self.registry)
        self.workers = Gauge("pdserve_router_workers", "Known workers by role and state", ("role", "state"), registry=r)
        self.auth_refused = Counter("pdserve_router_auth_refused_total",
                                    "Registry calls refused for want of a valid credential", ("reason",), registry=r)

    def count_auth_refusal(self, reason: str) -> None:
        self.auth_refused.labels(reason).inc()

    def observe_finished(self, last: decode_pb2.DecodeResponse) -> None:
        """Record what the last message of a Decode stream reports (fields it carries)."""
        if last.HasField("transfer"):
            verdict = last.transfer
            outcome = common_pb2.TransferOutcome.Name(verdict.outcome).removeprefix("TRANSFER_OUTCOME_").lower()
            self.transfers.labels(outcome, verdict.backend or "none").inc()
        if last.HasField("usage"):
            usage = last.usage
            self.prompt_tokens.labels("cached").inc(usage.cached_prompt_tokens)
            self.prompt_tokens.labels("computed").inc(max(0, usage.prompt_tokens - usage.cached_prompt_tokens))
            self.completion_tokens.inc(usage.completion_tokens)
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
            state = "suspect" if record.suspect and alive else ("alive" if alive else "dead")
            self.workers.labels(record.worker.role.value, state).inc()
        self.kv_backends.clear()
        for record in registry_view.alive():
            for backend in record.load.kv_backends:
                self.kv_backends.labels(record.worker_id, backend.name).set(1 if backend.usable else 0)
        return generate_latest(self.registry)

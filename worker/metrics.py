"""Prometheus metrics of a worker process (its own registry, no global state)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.proto.pdserve.v1 import common_pb2

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


RECENT_WEIGHT = 0.5  # a new transfer's weight in a link's recent averages


class WorkerMetrics:
    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_worker_requests", "requests by outcome", ["outcome"], registry=r)
        self.prefill_decisions = Counter("pdserve_prefill_decisions", "where prompts were prefilled",
                                         ["outcome", "reason"], registry=r)
        self.ttft_phase = Histogram("pdserve_ttft_phase_seconds", "time to first token by phase",
                                    ["phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.transfer_bytes = Counter("pdserve_transfer_bytes", "KV bytes moved", ["backend"], registry=r)
        self.transfer_seconds = Histogram("pdserve_transfer_seconds", "KV transfer latency", ["backend"],
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.transfer_tail_seconds = Histogram(
            "pdserve_transfer_tail_seconds", "end of the prompt's forward to the transfer's verdict "
            "(the transfer time not overlapped with compute)", ["backend"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.transfer_layer_send_seconds = Histogram(
            "pdserve_transfer_layer_send_seconds", "a layer-wise stream's mean time to send one "
            "message (one layer of one prefill step's blocks)", ["backend"], buckets=LATENCY_BUCKETS, registry=r)
        self.transfer_failures = Counter("pdserve_transfer_failures", "failed transfer steps",
                                         ["backend"], registry=r)
        self.kv_blocks_free = Gauge("pdserve_kv_blocks_free", "free KV blocks", registry=r)
        self.kv_blocks_total = Gauge("pdserve_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.prompt_tokens_computed = Gauge("pdserve_prompt_tokens_computed",
                                            "prompt tokens run through the model", registry=r)
        self.kv_backend_usable = Gauge("pdserve_kv_backend_usable", "1 while a KV transfer backend is "
                                       "usable (healthy or due a probe), 0 while it is skipped",
                                       ["backend"], registry=r)
        self.auth_refused = Counter("pdserve_auth_refused", "internal calls refused for want of a valid "
                                    "credential", ["reason"], registry=r)
        self.role = role
        # backend -> [transfers, bytes, seconds, failures] since start, for load reports
        self.transfer_totals: dict[str, list[float]] = {}
        # prefill worker id -> [transfers, bytes per block, bytes/s, tail s] received (decode);
        # the last three recent averages (RECENT_WEIGHT on each new transfer)
        self.received: dict[str, list[float]] = {}

    def watch_tiers(self, tiers) -> None:
        """Export the KV tiers under the pool (`kvtransfer.tiers.Tiers`; None: none), read at each scrape."""
        if tiers is not None:
            self.registry.register(TierCollector(tiers))

    def count_auth_refusal(self, reason: str) -> None:
        self.auth_refused.labels(reason=reason).inc()

    def observe_engine(self, stats) -> None:
        self.kv_blocks_free.set(stats.num_free_blocks)
        self.kv_blocks_total.set(stats.num_total_blocks)
        self.prompt_tokens_computed.set(stats.num_prompt_tokens_computed)

    def observe_backends(self, states) -> None:
        """The load report's KV backend states (`common_pb2.KVBackendState`s)."""
        for state in states:
            self.kv_backend_usable.labels(backend=state.name).set(1 if state.usable else 0)

    def observe_verdict(self, verdict, tail_ms: float = 0.0) -> None:
        """A transfer verdict; `tail_ms` (sender side): end of the prompt's forward to it."""
        if verdict.backend and tail_ms > 0:
            self.transfer_tail_seconds.labels(backend=verdict.backend).observe(tail_ms / 1000)
        if verdict.backend and verdict.num_messages:
            self.transfer_layer_send_seconds.labels(backend=verdict.backend).observe(verdict.layer_send_ms / 1000)
        for step in verdict.fallbacks:
            self.transfer_failures.labels(backend=step.backend).inc()
            self._totals(step.backend)[3] += 1
        if verdict.backend:
            self.transfer_bytes.labels(backend=verdict.backend).inc(verdict.num_bytes)
            self.transfer_seconds.labels(backend=verdict.backend).observe(verdict.duration_ms / 1000)
            totals = self._totals(verdict.backend)
            totals[0] += 1
            totals[1] += verdict.num_bytes
            totals[2] += verdict.duration_ms / 1000

    def observe_received(self, verdict, tail_ms: float) -> None:
        """A transfer that landed here (decode side), from the prefill worker `verdict.peer`;
        `tail_ms`: the end of its forward there until the blocks were verified here."""
        if not (verdict.peer and verdict.num_blocks and verdict.num_bytes and verdict.duration_s > 0):
            return
        sample = (verdict.num_bytes / verdict.num_blocks, verdict.num_bytes / verdict.duration_s, tail_ms / 1000)
        link = self.received.get(verdict.peer)
        if link is None:
            self.received[verdict.peer] = [1, *sample]
            return
        link[0] += 1
        for i, value in enumerate(sample, start=1):
            link[i] += RECENT_WEIGHT * (value - link[i])

    def _totals(self, backend: str) -> list[float]:
        return self.transfer_totals.setdefault(backend, [0, 0, 0.0, 0])

    def counters(self, stats):
        """The load report's `EngineCounters`: engine `stats` and this worker's transfers."""
        return common_pb2.EngineCounters(
            prompt_tokens_computed=stats.num_prompt_tokens_computed, generation_tokens=stats.num_generation_tokens,
            prefix_cache_queries=stats.num_prefix_queries, prefix_cache_hits=stats.num_prefix_hits,
            preemptions=stats.num_preemptions, steps=stats.num_steps, step_seconds=stats.step_seconds,
            transfers=[common_pb2.TransferCounters(backend=b, transfers=int(t[0]), bytes=int(t[1]), seconds=t[2],
                                                   failures=int(t[3]))
                       for b, t in sorted(self.transfer_totals.items())],
            received=[common_pb2.PeerTransferCounters(peer=p, transfers=int(t[0]), bytes_per_block=t[1],
                                                      bytes_per_s=t[2], tail_s=t[3])
                      for p, t in sorted(self.received.items())])

    def serve(self, host: str, port: int, token: str | None = None):
        """Serve /metrics on host:port (0: not at all); with `token`, only to its bearer."""
        from pdserve.common.metrics_http import MetricsServer

        if port:
            return MetricsServer(host, port, lambda: generate_latest(self.registry), token)
        return None


# (name, help, TierStats field, kind) of each per-tier series
_TIER_SERIES = (
    ("pdserve_kv_tier_blocks", "KV blocks a tier holds (a shared store: those this worker wrote)", "blocks", "gauge"),
    ("pdserve_kv_tier_bytes", "bytes of KV a tier holds (a shared store: those this worker wrote)", "bytes", "gauge"),
    ("pdserve_kv_tier_capacity_bytes", "a tier's bound in bytes (0: the store's own budget or TTL)",
     "capacity_bytes", "gauge"),
    ("pdserve_kv_tier_enabled", "1 while a tier is on, 0 while off (see its reason in the logs)", "enabled", "gauge"),
    ("pdserve_kv_tier_hits", "KV blocks onboarded from a tier into the pool", "hits", "counter"),
    ("pdserve_kv_tier_misses", "lookups that found nothing in a tier", "misses", "counter"),
    ("pdserve_kv_tier_evictions", "KV blocks a tier let go to stay within its bound", "evictions", "counter"),
    ("pdserve_kv_tier_corrupt", "records refused (MAC, format, truncated, digest): misses, never served",
     "corrupt", "counter"),
    ("pdserve_kv_tier_dropped", "KV blocks a tier did not take (queue full, tier off)", "dropped", "counter"),
    ("pdserve_kv_tier_onboard_seconds", "time finding, verifying and copying a tier's hits", "onboard_seconds",
     "counter"),
    ("pdserve_kv_tier_onboards", "lookups that onboarded blocks from a tier", "onboards", "counter"),
)


class TierCollector:
    """Per-tier series of the KV tiers, one label `tier` (device, host, disk, redis)."""

    def __init__(self, tiers) -> None:
        self._tiers = tiers

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snapshots = self._tiers.stats()
        for name, doc, attr, kind in _TIER_SERIES:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=["tier"])
            for snap in snapshots:
                family.add_metric([snap.tier], float(getattr(snap, attr)))
            yield family

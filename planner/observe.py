"""What the live planner sees: the router's own /metrics, read every interval.

A `Sample` is one scrape reduced to the cumulative numbers the planner needs; `observe`
turns two consecutive samples into one interval's `Observation`. Arrivals are not counted
by the router, so they are derived: requests that finished in the interval plus the growth
of the requests in flight. Mean lengths are those of the requests that finished. SLO
attainment is read off the router's TTFT and inter-token histograms: the share of the
interval's observations at or under the target, interpolated linearly inside the bucket
that holds it (so it is as fine as the buckets are). With nothing finished in an interval,
attainment is 1 (nothing missed) and the lengths are the previous interval's.
"""
from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from pdserve.planner.types import Slo, WorkloadStats

ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class Sample:
    """The cumulative numbers of one scrape of the router's /metrics, taken at `at` (seconds)."""
    at: float
    num_finished: float = 0.0  # pdserve_router_requests_total, every outcome
    num_failed: float = 0.0  # ... outcomes other than ok and the client leaving (OK_OUTCOMES)
    num_in_flight: float = 0.0
    prompt_tokens: float = 0.0
    completion_tokens: float = 0.0
    ttft_buckets: tuple[tuple[float, float], ...] = ()  # (upper bound s, cumulative count)
    itl_buckets: tuple[tuple[float, float], ...] = ()
    latency_sum_s: float = 0.0  # pdserve_router_request_latency_seconds: sum and count
    latency_count: float = 0.0
    queued: Mapping[str, float] = field(default_factory=dict)  # role -> requests waiting, every live worker
    running: Mapping[str, float] = field(default_factory=dict)
    num_alive: Mapping[str, int] = field(default_factory=dict)  # role -> routable workers
    kv_usage: float = 0.0  # mean share of KV in use over live decode workers
    prefill_tokens_per_s: float = 0.0  # mean measured prefill rate over live prefill workers (0: none yet)


@dataclass(frozen=True, slots=True)
class Observation:
    """One interval of the deployment as the router saw it."""
    at: float
    interval_s: float
    load: WorkloadStats
    num_finished: float
    num_failed: float
    ttft_attainment: float  # share of first tokens within the SLO's TTFT
    tpot_attainment: float  # share of inter-token gaps within the SLO's TPOT
    mean_latency_s: float  # of the requests that finished (0: none)
    num_in_flight: float  # requests admitted and not finished, at the interval's end
    queued: Mapping[str, float]
    running: Mapping[str, float]
    num_alive: Mapping[str, int]
    kv_usage: float
    prefill_tokens_per_s: float


OK_OUTCOMES = ("ok", "aborted")  # aborted: the client left; anything else failed


def parse(text: str, at: float) -> Sample:
    """A `Sample` of the router's exposition `text`."""
    from prometheus_client.parser import text_string_to_metric_families

    n = dict(num_finished=0.0, num_failed=0.0, num_in_flight=0.0, prompt_tokens=0.0, completion_tokens=0.0,
             latency_sum_s=0.0, latency_count=0.0)
    ttft: dict[float, float] = {}
    itl: dict[float, float] = {}
    queued = {r: 0.0 for r in ROLES}
    running = {r: 0.0 for r in ROLES}
    alive = {r: 0 for r in ROLES}
    usage: list[float] = []
    rates: list[float] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            _take(s.name, s.labels, s.value, n, ttft, itl, queued, running, alive, usage, rates)
    return Sample(at, **n, ttft_buckets=tuple(sorted(ttft.items())), itl_buckets=tuple(sorted(itl.items())),
                  queued=queued, running=running, num_alive=alive,
                  kv_usage=sum(usage) / len(usage) if usage else 0.0,
                  prefill_tokens_per_s=sum(rates) / len(rates) if rates else 0.0)


def _take(name, labels, value, n, ttft, itl, queued, running, alive, usage, rates) -> None:
    role = labels.get("role", "")
    if name == "pdserve_router_requests_total":
        n["num_finished"] += value
        if labels.get("outcome") not in OK_OUTCOMES:
            n["num_failed"] += value
    elif name == "pdserve_router_in_flight_requests":
        n["num_in_flight"] = value
    elif name == "pdserve_router_prompt_tokens_total":
        n["prompt_tokens"] += value
    elif name == "pdserve_router_completion_tokens_total":
        n["completion_tokens"] = value
    elif name == "pdserve_router_ttft_seconds_bucket":
        ttft[float(labels["le"])] = value
    elif name == "pdserve_router_inter_token_latency_seconds_bucket":
        itl[float(labels["le"])] = value
    elif name == "pdserve_router_request_latency_seconds_sum":
        n["latency_sum_s"] = value
    elif name == "pdserve_router_request_latency_seconds_count":
        n["latency_count"] = value
    elif name == "pdserve:num_requests_waiting" and role in queued:
        queued[role] += value
    elif name == "pdserve:num_requests_running" and role in running:
        running[role] += value
    elif name == "pdserve:kv_cache_usage_perc" and role == "decode":
        usage.append(value)
    elif name == "pdserve:prefill_tokens_per_s" and role == "prefill" and value > 0:
        rates.append(value)
    elif name == "pdserve_router_workers" and role in alive and labels.get("state") == "alive":
        alive[role] += int(value)


def observe(before: Sample, after: Sample, slo: Slo, last: WorkloadStats | None = None) -> Observation:
    """The interval from `before` to `after`. `last`: the previous interval's load, whose
    lengths stand in when nothing finished in this one."""
    dt = max(1e-3, after.at - before.at)
    finished = max(0.0, after.num_finished - before.num_finished)
    arrivals = max(0.0, finished + after.num_in_flight - before.num_in_flight)
    if finished > 0:
        mean_in = max(0.0, after.prompt_tokens - before.prompt_tokens) / finished
        mean_out = max(0.0, after.completion_tokens - before.completion_tokens) / finished
    else:
        mean_in = last.mean_input_len if last is not None else 0.0
        mean_out = last.mean_output_len if last is not None else 0.0
    num_latency = after.latency_count - before.latency_count
    latency = (after.latency_sum_s - before.latency_sum_s) / num_latency if num_latency > 0 else 0.0
    return Observation(
        at=after.at, interval_s=dt, load=WorkloadStats(arrivals / dt, mean_in, mean_out),
        num_finished=finished, num_failed=max(0.0, after.num_failed - before.num_failed),
        ttft_attainment=_share_within(before.ttft_buckets, after.ttft_buckets, slo.ttft_ms / 1000),
        tpot_attainment=_share_within(before.itl_buckets, after.itl_buckets, slo.tpot_ms / 1000),
        mean_latency_s=latency, num_in_flight=after.num_in_flight, queued=dict(after.queued), running=dict(after.running),
        num_alive=dict(after.num_alive), kv_usage=after.kv_usage, prefill_tokens_per_s=after.prefill_tokens_per_s)


def _share_within(before, after, bound_s: float) -> float:
    """Share of the observations between two cumulative histograms at or under `bound_s`."""
    counts = dict(after)
    for le, value in before:
        counts[le] = counts.get(le, 0.0) - value
    edges = sorted(counts)
    total = counts.get(math.inf, counts[edges[-1]] if edges else 0.0)
    if total <= 0:
        return 1.0
    lower, below = 0.0, 0.0
    for le in edges:
        if bound_s < le:
            if math.isinf(le):
                return below / total
            part = (bound_s - lower) / (le - lower) if le > lower else 1.0
            return (below + part * (counts[le] - below)) / total
        lower, below = le, counts[le]
    return below / total


class RouterScrape:
    """Reads a router's /metrics over HTTP(S), with the API key when the router asks for one."""

    def __init__(self, url: str, api_key: str = "", timeout_s: float = 5.0,
                 clock: Callable[[], float] | None = None) -> None:
        import time

        self.url = url.rstrip("/") + "/metrics" if not url.endswith("/metrics") else url
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout_s = timeout_s
        self._clock = clock or time.monotonic

    def sample(self) -> Sample:
        """OSError when the router does not answer within the timeout."""
        import ssl

        context = ssl._create_unverified_context() if self.url.startswith("https:") else None
        request = urllib.request.Request(self.url, headers=self._headers)
        with urllib.request.urlopen(request, timeout=self._timeout_s, context=context) as resp:
            text = resp.read().decode()
        return parse(text, self._clock())


def shifted(sample: Sample, at: float) -> Sample:
    """`sample` as if taken at `at` (tests replay recorded samples on their own clock)."""
    return replace(sample, at=at)

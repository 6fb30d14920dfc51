"""A deployment under a workload, in simulated time (simpy): the router's rules over simulated
engines (`sim_engine.py`), and what each request saw.

The router, as `router/planner.py` decides: the decode with the least load (requests waiting,
running or waiting for KV; the default `prefix_aware` policy without a prefix match), then
local or remote prefill: local when the uncached prompt is at or under
`local_prefill_threshold`, when there is no prefill worker, or when the least loaded prefill
worker has `prefill_queue_threshold` or more requests waiting; between those, the path with
the shorter predicted first token (each side's queued prompt tokens and this prompt at the
profile's prefill rate, the transfer on the remote side, the stall of the decode's streams on
the local side) unless `predict` is off (`--static-routing`). A remote prompt: the decode
admits it (holding its blocks), the prefill worker computes it, its KV crosses the prefill
worker's link (the profile's transfer cost past the forward, transfers queued on the link), and
the decode takes it, with its first token, when its running step ends.

A request's TTFT runs from its arrival to its first token, its TPOT from the first token to
the last over the tokens between. Requests unfinished at the horizon count as missing every
SLO (TTFT and TPOT infinite).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import simpy

from pdserve.planner.profile import Profile, TransferCost
from pdserve.planner.sim_engine import EngineKnobs, Host, SimEngine, SimRequest
from pdserve.planner.types import Slo
from pdserve.planner.workload import TraceRequest

PREFILL_KNOBS = EngineKnobs(max_num_tokens=256, chunking_policy="SHORTEST_FIRST")  # the role defaults
DECODE_KNOBS = EngineKnobs(max_num_tokens=256)  # (worker/settings.py ROLE_DEFAULTS)


@dataclass(frozen=True, slots=True)
class Deployment:
    """One candidate: worker counts, each role's engine knobs and the router's thresholds.
    `host_cores`: the cores every worker shares (one host: CPU); 0: each worker has its own
    device."""

    num_prefill: int
    num_decode: int
    decode: EngineKnobs = DECODE_KNOBS
    prefill: EngineKnobs = PREFILL_KNOBS
    local_prefill_threshold: int = 32
    prefill_queue_threshold: int = 8
    predict: bool = True
    backend: str = ""  # the transfer link ("": the profile's fastest)
    layerwise: bool = True
    host_cores: int = 0

    @property
    def config(self) -> str:
        return "colocated" if self.num_prefill == 0 else f"{self.num_prefill}p{self.num_decode}d"


@dataclass(frozen=True, slots=True)
class SimResult:
    """Per request (in trace order): TTFT and TPOT in seconds (inf: never came), how its prompt
    was served, and each pool's busy fraction."""

    ttft_s: np.ndarray
    tpot_s: np.ndarray
    remote: np.ndarray  # bool
    transfer_s: np.ndarray
    duration_s: float
    prefill_busy: float
    decode_busy: float
    extra: dict = field(default_factory=dict)

    def percentile_ms(self, which: str, q: float) -> float:
        values = self.ttft_s if which == "ttft" else self.tpot_s
        # a sample, not an interpolation: unfinished requests are inf, and inf - inf is no time
        return float(np.percentile(values, q, method="higher")) * 1000.0 if len(values) else math.inf

    def met(self, slo: Slo) -> np.ndarray:
        return (self.ttft_s * 1000 <= slo.ttft_ms) & (self.tpot_s * 1000 <= slo.tpot_ms)

    def attainment(self, slo: Slo) -> float:
        return float(self.met(slo).mean()) if len(self.ttft_s) else 0.0

    def meets(self, slo: Slo) -> bool:
        """Both percentiles within their SLOs and at least `slo.attainment` of requests within both."""
        return (self.attainment(slo) >= slo.attainment
                and self.percentile_ms("ttft", slo.percentile) <= slo.ttft_ms
                and self.percentile_ms("tpot", slo.percentile) <= slo.tpot_ms)


class _Fleet:
    """The router and the engines of one deployment; hears the engines' events."""

    def __init__(self, env: simpy.Environment, profile: Profile, deployment: Deployment) -> None:
        self.env, self.profile, self.deployment = env, profile, deployment
        host = Host(deployment.host_cores or None, profile.threads)
        self.decodes = [SimEngine(env, f"decode-{i}", profile, deployment.decode, host, self)
                        for i in range(deployment.num_decode)]
        self.prefills = [SimEngine(env, f"prefill-{i}", profile, deployment.prefill, host, self)
                         for i in range(deployment.num_prefill)]
        self.link: TransferCost | None = profile.transfer(deployment.backend or None)
        if deployment.num_prefill and self.link is None:
            raise ValueError("a disaggregated deployment needs a transfer cost in the profile")
        self._decode_of: dict[int, SimEngine] = {}  # remote requests: the decode holding their blocks
        self._link_free: dict[str, float] = {}  # prefill worker -> when its link has sent what it was given
        self.num_left = 0  # requests not finished yet
        self.done = env.event()  # every request finished

    # -- the router ---------------------------------------------------------------------------
    def arrive(self, request: SimRequest) -> None:
        decode = min(self.decodes, key=lambda e: e.load)
        request.remote = self._remote(decode, request) is not None
        if request.remote:
            twin = SimRequest(request.rid, request.arrival_s, request.input_len, 1, request.cached_len,
                              prefill_only=True)
            twin.twin, request.twin = request, twin
        decode.add(request)

    def _remote(self, decode: SimEngine, request: SimRequest) -> SimEngine | None:
        d = self.deployment
        uncached = request.input_len - request.cached_len
        if uncached <= d.local_prefill_threshold or not self.prefills:
            return None
        prefill = min(self.prefills, key=lambda e: e.load)
        if len(prefill.waiting) >= d.prefill_queue_threshold:
            return None
        if not d.predict:
            return prefill
        rate = uncached / self.profile.step.prefill_s(uncached, request.cached_len)
        compute = uncached / rate
        transfer = self.link.past_forward_s(uncached * self.profile.kv_bytes_per_token, compute, d.layerwise)
        remote = prefill.queued_prompt_tokens / rate + compute + transfer
        local = (decode.queued_prompt_tokens + uncached) / rate
        return None if local + compute < remote else prefill

    # -- what the engines report ----------------------------------------------------------------
    def remote_admitted(self, decode: SimEngine, request: SimRequest) -> None:
        request.twin.twin = request  # the decode's copy, for prompt_done
        self._decode_of[request.rid] = decode
        min(self.prefills, key=lambda e: e.load).add(request.twin)

    def prompt_done(self, prefill: SimEngine, twin: SimRequest) -> None:
        """The KV leaves over the prefill worker's link, one transfer after another: streamed
        layer by layer it starts with the forward, so only what outlasts the forward (or the
        link's tail) delays the first token; a link slower than the prompts' KV is made falls
        behind, and the transfers queue on it."""
        num_bytes = (twin.input_len - twin.cached_len) * self.profile.kv_bytes_per_token
        now, link = self.env.now, self.link
        begin = now - twin.forward_s if self.deployment.layerwise else now
        wire_start = max(begin, self._link_free.get(prefill.name, 0.0))
        wire_end = wire_start + num_bytes / link.bytes_per_s
        self._link_free[prefill.name] = wire_end
        done = max(now + link.tail_s, wire_end) if self.deployment.layerwise else wire_end + link.tail_s
        self.env.process(self._deliver(prefill, twin, done - now))

    def _deliver(self, prefill: SimEngine, twin: SimRequest, transfer_s: float):
        yield self.env.timeout(transfer_s)
        prefill.release(twin)
        request = twin.twin
        request.transfer_s = transfer_s
        decode = self._decode_of.pop(request.rid)
        # the decode takes the landed KV and its first token between two of its steps
        decode.between_steps(lambda: self._first_token(decode, request))

    def _first_token(self, decode: SimEngine, request: SimRequest) -> None:
        request.generated = 1
        request.first_token_s = self.env.now
        if request.output_len <= 1:
            self._finished(request)
            del decode.remote[request.rid]
            decode.release(request)
            return
        decode.finish_remote(request)

    def token(self, engine: SimEngine, request: SimRequest) -> None:
        if math.isnan(request.first_token_s):
            request.first_token_s = self.env.now
        if request.generated >= request.output_len:
            self._finished(request)

    def _finished(self, request: SimRequest) -> None:
        request.finish_s = self.env.now
        self.num_left -= 1
        if self.num_left == 0 and not self.done.triggered:
            self.done.succeed()


def simulate(profile: Profile, deployment: Deployment, trace: Sequence[TraceRequest],
             horizon_s: float | None = None, warmup: float = 0.0) -> SimResult:
    """Run `trace` through `deployment` until every request ends or `horizon_s` passes (default:
    the trace's span plus ten minutes). The first `warmup` fraction of requests is left out of
    the result (they met an empty deployment)."""
    env = simpy.Environment()
    fleet = _Fleet(env, profile, deployment)
    max_len = profile.max_model_len
    requests = [SimRequest(i, r.arrival_s, min(r.input_len, max_len - 1),
                           max(1, min(r.output_len, max_len - min(r.input_len, max_len - 1))),
                           min(r.cached_len, max(0, min(r.input_len, max_len - 1) - 1)))
                for i, r in enumerate(trace)]

    def arrivals():
        for request in requests:
            delay = request.arrival_s - env.now
            if delay > 0:
                yield env.timeout(delay)
            fleet.arrive(request)

    env.process(arrivals())
    end = (trace[-1].arrival_s if trace else 0.0) + (600.0 if horizon_s is None else horizon_s)
    fleet.num_left = len(requests)
    if requests:
        env.process(_deadline(env, fleet.done, end))
        env.run(until=fleet.done)
    return _result(requests[int(len(requests) * warmup):], fleet, env.now)


def _deadline(env: simpy.Environment, done: simpy.Event, end: float):
    yield env.timeout(end)
    if not done.triggered:
        done.succeed()


def _result(requests: list[SimRequest], fleet: _Fleet, now: float) -> SimResult:
    ttft = np.array([r.first_token_s - r.arrival_s if not math.isnan(r.first_token_s) else math.inf
                     for r in requests])
    tpot = np.array([(r.finish_s - r.first_token_s) / (r.output_len - 1) if r.output_len > 1 and
                     not math.isnan(r.finish_s) else (0.0 if r.output_len <= 1 and not math.isnan(r.finish_s)
                                                      else math.inf) for r in requests])
    duration = max(now, 1e-9)

    def busy(engines: list[SimEngine]) -> float:
        return sum(e.busy_s for e in engines) / (len(engines) * duration) if engines else 0.0

    return SimResult(ttft, tpot, np.array([r.remote for r in requests], dtype=bool),
                     np.array([r.transfer_s for r in requests]), duration,
                     busy(fleet.prefills), busy(fleet.decodes))

"""Which deployment serves a workload best: candidates simulated and ranked.

A budget of D devices (GPUs, or `Profile.threads` cores per worker on CPU) holds replicas of
one unit, colocated (one worker) or xPyD (x prefill and y decode workers); the router spreads
load evenly over the replicas, so one unit is simulated at its share of the load. Each unit is
tried with each chunk budget, batch limit and local-prefill threshold asked for.

Ranking: candidates that meet the SLO (`SimResult.meets`) first, by goodput per device
(requests per second that met both SLOs, over the devices the candidate uses), then by the
worse of the two percentile latencies relative to its SLO (`slack`); the rest after them,
nearest (least `slack`) first. `bound` names what limits a
candidate: `prefill` when TTFT is further over (or nearer) its SLO than TPOT and the prompt's
own queue and compute dominate it, `transfer` when the KV's transfer does, `decode` when TPOT is.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from pdserve.planner.profile import Profile
from pdserve.planner.sim_engine import EngineKnobs
from pdserve.planner.simulator import DECODE_KNOBS, PREFILL_KNOBS, Deployment, SimResult, simulate
from pdserve.planner.types import Advice, Limits, Shape, Slo, WorkloadStats
from pdserve.planner.workload import TraceRequest, random_workload, scaled


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """What the search varies. `max_unit`: the most workers in one replica unit."""

    chunk_budgets: tuple[int, ...] = (256, 2048)
    batch_limits: tuple[int, ...] = (64,)
    local_prefill_thresholds: tuple[int, ...] = (32,)
    max_unit: int = 8
    colocated: bool = True
    disaggregated: bool = True
    shared_host_cores: int = 0  # CPU on one host: every worker shares these cores (0: own devices)


@dataclass(frozen=True, slots=True)
class Candidate:
    deployment: Deployment  # the whole fleet's counts; the unit's knobs
    replicas: int
    unit: Deployment
    devices: int


@dataclass(frozen=True, slots=True)
class Evaluation:
    candidate: Candidate
    result: SimResult
    slo: Slo
    request_rate: float

    @property
    def config(self) -> str:
        return self.candidate.deployment.config

    @property
    def meets(self) -> bool:
        return self.result.meets(self.slo)

    @property
    def attainment(self) -> float:
        return self.result.attainment(self.slo)

    @property
    def goodput_rps(self) -> float:
        rate = self.request_rate if math.isfinite(self.request_rate) else 0.0
        return rate * self.attainment

    @property
    def goodput_per_device(self) -> float:
        return self.goodput_rps / self.candidate.devices

    def ms(self, which: str, q: float) -> float:
        return self.result.percentile_ms(which, q)

    @property
    def slack(self) -> float:
        """The worse of TTFT and TPOT at the SLO's percentile, over its bound (< 1: within)."""
        q = self.slo.percentile
        return max(self.ms("ttft", q) / self.slo.ttft_ms, self.ms("tpot", q) / self.slo.tpot_ms)

    @property
    def bound(self) -> str:
        q = self.slo.percentile
        ttft, tpot = self.ms("ttft", q) / self.slo.ttft_ms, self.ms("tpot", q) / self.slo.tpot_ms
        if tpot >= ttft:
            return "decode"
        remote = self.result.remote
        if remote.any():
            transfer = float(self.result.transfer_s[remote].mean())
            if transfer * 1000 > 0.5 * self.ms("ttft", 50):
                return "transfer"
        return "prefill"

    def as_json(self) -> dict:
        d = self.candidate.deployment
        return {"config": self.config, "num_prefill": d.num_prefill, "num_decode": d.num_decode,
                "replicas": self.candidate.replicas, "devices": self.candidate.devices,
                "max_num_tokens": d.decode.max_num_tokens, "max_batch_size": d.decode.max_batch_size,
                "local_prefill_threshold": d.local_prefill_threshold,
                "ttft_p50_ms": _finite(self.ms("ttft", 50)), "ttft_p90_ms": _finite(self.ms("ttft", 90)),
                "tpot_p50_ms": _finite(self.ms("tpot", 50)), "tpot_p90_ms": _finite(self.ms("tpot", 90)),
                "attainment": round(self.attainment, 4), "goodput_rps": round(self.goodput_rps, 4),
                "goodput_per_device": round(self.goodput_per_device, 4), "meets_slo": self.meets,
                "bound": self.bound, "prefill_busy": round(self.result.prefill_busy, 3),
                "decode_busy": round(self.result.decode_busy, 3),
                "remote_fraction": round(float(self.result.remote.mean()), 3) if len(self.result.remote) else 0.0}


def _finite(ms: float) -> float | None:
    return round(ms, 2) if math.isfinite(ms) else None


def units(max_workers: int, space: SearchSpace) -> list[tuple[int, int]]:
    """(prefill, decode) worker counts of a replica unit within `max_workers`."""
    out: list[tuple[int, int]] = [(0, 1)] if space.colocated else []
    if space.disaggregated:
        top = min(max_workers, space.max_unit)
        out += [(x, y) for x in range(1, top) for y in range(1, top - x + 1)]
    return [u for u in out if sum(u) <= max_workers]


def candidates(profile: Profile, devices: int, space: SearchSpace) -> list[Candidate]:
    """Every unit and knob setting the budget holds, at the most replicas it holds. On a shared
    host (CPU), also with fewer replicas: more workers than cores only contend."""
    max_workers = devices // profile.devices_per_worker
    if max_workers < 1:
        raise ValueError(f"a budget of {devices} devices holds no worker of {profile.devices_per_worker}")
    out = []
    for num_prefill, num_decode in units(max_workers, space):
        size = num_prefill + num_decode
        counts = range(1, max_workers // size + 1) if space.shared_host_cores else (max_workers // size,)
        for replicas in counts:
            for unit in _knobs(num_prefill, num_decode, space):
                fleet = dataclasses.replace(unit, num_prefill=num_prefill * replicas, num_decode=num_decode * replicas)
                # on a shared host every candidate uses the whole host
                used = space.shared_host_cores or size * replicas * profile.devices_per_worker
                out.append(Candidate(fleet, replicas, unit, used))
    return out


def _knobs(num_prefill: int, num_decode: int, space: SearchSpace) -> Iterable[Deployment]:
    thresholds = space.local_prefill_thresholds if num_prefill else (0,)
    for budget, batch, threshold in itertools.product(space.chunk_budgets, space.batch_limits, thresholds):
        # `up --max-num-tokens` sets both roles; the prefill keeps its own chunking policy
        decode = dataclasses.replace(DECODE_KNOBS, max_num_tokens=budget, max_batch_size=batch)
        prefill = dataclasses.replace(PREFILL_KNOBS, max_num_tokens=budget, max_batch_size=batch)
        yield Deployment(num_prefill, num_decode, decode=decode, prefill=prefill,
                         local_prefill_threshold=threshold if num_prefill else 32,
                         host_cores=space.shared_host_cores)


WARMUP = 0.1  # the fraction of a trace's first requests a prediction leaves out (an empty fleet)


def evaluate(profile: Profile, candidate: Candidate, trace: Sequence[TraceRequest], slo: Slo,
             request_rate: float, warmup: float = WARMUP) -> Evaluation:
    """`candidate` under `trace` (the whole fleet's load): on a shared host the whole fleet is
    simulated, else one unit at 1/replicas of the load."""
    if candidate.unit.host_cores or candidate.replicas == 1:
        deployment = candidate.deployment if candidate.unit.host_cores else candidate.unit
        result = simulate(profile, deployment, trace, warmup=warmup)
    else:
        result = simulate(profile, candidate.unit, scaled(trace, 1 / candidate.replicas), warmup=warmup)
    return Evaluation(candidate, result, slo, request_rate)


def rank(evaluations: Iterable[Evaluation]) -> list[Evaluation]:
    """Those that meet the SLO by goodput per device; after them the rest, nearest first."""
    def key(e: Evaluation):
        if e.meets:
            return (0, -round(e.goodput_per_device, 9), e.slack, e.candidate.devices)
        return (1, e.slack, -round(e.goodput_per_device, 9), e.candidate.devices)

    return sorted(evaluations, key=key)


def plan(profile: Profile, trace: Sequence[TraceRequest], slo: Slo, devices: int, request_rate: float,
         space: SearchSpace = SearchSpace()) -> list[Evaluation]:
    """Every candidate within `devices`, ranked (best first)."""
    return rank(evaluate(profile, c, trace, slo, request_rate) for c in candidates(profile, devices, space))


def steady_count(profile: Profile, rate: float, input_len: int, output_len: int, least: int,
                 most: int = 2000) -> int:
    """Requests enough for a queue at `rate` to reach its steady state: arrivals over ten
    lifetimes of a request in a full batch (a shorter trace measures only the first burst,
    which the batch absorbs), between `least` and `most`."""
    step = profile.step.seconds(0, 0, 64, 64 * (input_len + output_len // 2))
    lifetime = profile.step.prefill_s(input_len) + output_len * step
    return int(min(most, max(least, rate * 10 * lifetime))) if math.isfinite(rate) else least


def max_goodput(profile: Profile, unit: Deployment, slo: Slo, input_len: int, output_len: int,
                num_requests: int = 300, seed: int = 0, low: float = 0.0, high: float | None = None,
                iterations: int = 9, trace_of=None) -> float:
    """The highest request rate at which `unit` meets `slo` (DistServe's goodput), by bisection.
    `trace_of(rate, count)`: the workload at a rate (default: `random_workload` of these lengths);
    each rate gets at least `num_requests` requests and enough for its steady state."""
    def trace(rate: float):
        count = steady_count(profile, rate, input_len, output_len, num_requests)
        return trace_of(rate, count) if trace_of else random_workload(rate, input_len, output_len, count, seed)

    if high is None:
        # above capacity: every worker either computing prompts back to back or decoding full batches
        step = profile.step
        prompts = 1.0 / step.prefill_s(input_len)
        batch = unit.decode.max_batch_size
        streams = batch / (output_len * step.seconds(0, 0, batch, batch * (input_len + output_len // 2)))
        high = 2.0 * (unit.num_prefill + unit.num_decode) * (prompts + streams)
    if not simulate(profile, unit, trace(max(high / 1000, 1e-6)), warmup=WARMUP).meets(slo):
        return 0.0
    low = max(low, high / 1000)
    for _ in range(iterations):
        mid = math.sqrt(low * high)
        if simulate(profile, unit, trace(mid), warmup=WARMUP).meets(slo):
            low = mid
        else:
            high = mid
    return low


class SimulatedAdvisor:
    """The live planner's `Advisor` backed by the simulator: the cheapest shape within `limits`
    (fewest workers, then most goodput) that meets the SLO at the load; else the nearest."""

    name = "simulator"

    def __init__(self, profile: Profile, space: SearchSpace = SearchSpace(chunk_budgets=(256,)),
                 num_requests: int = 200, seed: int = 0) -> None:
        self.profile, self.space, self.num_requests, self.seed = profile, space, num_requests, seed

    def advise(self, load: WorkloadStats, slo: Slo, limits: Limits) -> Advice:
        rate, input_len = max(load.request_rate, 1e-3), max(1, round(load.mean_input_len))
        output_len = max(1, round(load.mean_output_len))
        count = steady_count(self.profile, rate, input_len, output_len, self.num_requests, most=4 * self.num_requests)
        trace = random_workload(rate, input_len, output_len, count, self.seed)
        shapes = [Shape(p, d) for p in range(limits.min_prefill, limits.max_prefill + 1)
                  for d in range(max(1, limits.min_decode), limits.max_decode + 1)]
        evaluations = []
        for shape in shapes:
            knobs = next(_knobs(shape.num_prefill, shape.num_decode, self.space))
            deployment = dataclasses.replace(knobs, num_prefill=shape.num_prefill, num_decode=shape.num_decode)
            candidate = Candidate(deployment, 1, deployment,
                                  (shape.num_prefill + shape.num_decode) * self.profile.devices_per_worker)
            evaluations.append((shape, evaluate(self.profile, candidate, trace, slo, load.request_rate)))
        meeting = [(s, e) for s, e in evaluations if e.meets]
        if meeting:
            shape, best = min(meeting, key=lambda se: (se[0].num_prefill + se[0].num_decode, -se[1].goodput_rps))
            return Advice(shape, True, f"{shape.config} is the smallest shape meeting the SLO "
                                       f"(predicted TTFT p{slo.percentile:g} {best.ms('ttft', slo.percentile):.0f} ms, "
                                       f"TPOT {best.ms('tpot', slo.percentile):.0f} ms)", best.bound)
        shape, best = min(evaluations, key=lambda se: se[1].slack)
        return Advice(shape, False, f"no shape within the limits meets the SLO; nearest {shape.config} "
                                    f"(attainment {best.attainment:.0%})", best.bound)

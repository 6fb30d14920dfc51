"""The fallback advisor: sizes each role from the router's own observations by two rules and
three thresholds, for use until (or where) the simulator-backed advisor of `planner.search`
is not available. It predicts nothing about SLOs; it reacts to what the last interval showed.

- decode: the streams the forecast load keeps open (Little's law: forecast arrival rate x the
  mean request time just observed; at least the requests in flight now, which an interval
  shorter than a request's life would otherwise miss) over `streams_per_decode`, rounded up;
  one more than ready now while the SLO's TPOT attainment is below target, a request waits
  for admission on a decode, or the decodes' KV use is at or over `kv_high`.
- prefill: the prompt tokens per second the forecast load brings over what one prefill worker
  computes (its measured rate x `prefill_utilisation`), rounded up; one more than ready now
  while TTFT attainment is below target and prompts queue at the prefill workers. Before any
  rate is measured the count stays as it is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.planner.observe import Observation
from pdserve.planner.types import Advice, Limits, Shape, Slo, WorkloadStats


@dataclass(frozen=True, slots=True)
class ThresholdRules:
    streams_per_decode: float = 8.0
    prefill_utilisation: float = 0.7
    kv_high: float = 0.8


class ThresholdAdvisor:
    """An `Advisor` that also takes each interval's `Observation` (`note`) before `advise`."""

    name = "threshold-fallback"

    def __init__(self, rules: ThresholdRules = ThresholdRules()) -> None:
        self.rules = rules
        self._seen: Observation | None = None

    def note(self, observation: Observation) -> None:
        self._seen = observation

    def advise(self, load: WorkloadStats, slo: Slo, limits: Limits) -> Advice:
        seen = self._seen
        if seen is None:
            return Advice(Shape(limits.min_prefill, max(1, limits.min_decode)), True, "nothing observed yet")
        decode, why_d = self._decode(load, slo, seen)
        prefill, why_p = self._prefill(load, slo, seen)
        prefill = min(max(prefill, limits.min_prefill), limits.max_prefill)
        decode = min(max(decode, limits.min_decode, 1), limits.max_decode)
        pressed = seen.tpot_attainment < slo.attainment or seen.ttft_attainment < slo.attainment
        bound = "decode" if seen.tpot_attainment < slo.attainment else (
            "prefill" if seen.ttft_attainment < slo.attainment else "none")
        return Advice(Shape(prefill, decode), not pressed, f"decode: {why_d}; prefill: {why_p}", bound)

    def _decode(self, load: WorkloadStats, slo: Slo, seen: Observation) -> tuple[int, str]:
        ready = seen.num_alive.get("decode", 1)
        streams = max(load.request_rate * seen.mean_latency_s, seen.num_in_flight)
        need = max(1, math.ceil(streams / self.rules.streams_per_decode - 1e-9))
        why = f"{streams:.1f} streams forecast"
        if seen.tpot_attainment < slo.attainment:
            need, why = max(need, ready + 1), f"TPOT attainment {seen.tpot_attainment:.2f} < {slo.attainment:g}"
        elif seen.queued.get("decode", 0) > 0:
            need, why = max(need, ready + 1), f"{seen.queued['decode']:g} waiting for admission"
        elif seen.kv_usage >= self.rules.kv_high:
            need, why = max(need, ready + 1), f"KV use {seen.kv_usage:.2f} >= {self.rules.kv_high:g}"
        return need, why

    def _prefill(self, load: WorkloadStats, slo: Slo, seen: Observation) -> tuple[int, str]:
        ready = seen.num_alive.get("prefill", 0)
        per_worker = seen.prefill_tokens_per_s * self.rules.prefill_utilisation
        if per_worker <= 0:
            need, why = ready, "no prefill rate measured yet"
        else:
            tokens = load.request_rate * load.mean_input_len
            need, why = math.ceil(tokens / per_worker - 1e-9), f"{tokens:.0f} prompt tokens/s forecast"
        if seen.ttft_attainment < slo.attainment and seen.queued.get("prefill", 0) > 0:
            need, why = max(need, ready + 1), f"TTFT attainment {seen.ttft_attainment:.2f} with prompts queued"
        return need, why

"""The live planner: every interval it reads the router's metrics, forecasts the next
interval, asks its `Advisor` what to run, and moves the prefill and decode worker counts
toward that through a `Scaler`, within limits and with hysteresis.

Rules it keeps:
- Forecast: Holt's linear trend on the arrival rate (level and trend smoothed with `alpha`
  and `beta`), one interval ahead, never below zero; lengths are the last interval's.
- Limits: a role's count stays within its min/max, and never below one for a role the
  deployment runs (a scaler manages only the roles it runs).
- Hysteresis: a role changes only after `agree_intervals` consecutive intervals asked to move
  it the same way, and not within `cooldown_up_s` (`cooldown_down_s` for a removal) of its
  last change. Growth goes straight to the advised count; shrinking removes one worker at a
  time (each drains).
- A start that failed is reported (log, `pdserve_planner_failed_starts_total`) and asked for
  again after a back-off that doubles per consecutive failure up to `max_backoff_s`; it never
  counts as capacity (only `ready` workers do).
Every decision, a hold included, is logged with its reason and counted in
`pdserve_planner_decisions_total{role, action, reason}`.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, runtime_checkable

from pdserve.planner.observe import Observation, Sample, observe
from pdserve.planner.scalers import RoleCount, Scaler
from pdserve.planner.types import Advice, Advisor, Limits, Slo, WorkloadStats

log = logging.getLogger("pdserve.planner.live")


@dataclass(frozen=True, slots=True)
class LiveConfig:
    interval_s: float = 10.0
    agree_intervals: int = 2
    cooldown_up_s: float = 20.0
    cooldown_down_s: float = 40.0
    backoff_s: float = 5.0
    max_backoff_s: float = 80.0
    alpha: float = 0.6
    beta: float = 0.3


@runtime_checkable
class ObservingAdvisor(Protocol):
    """An advisor that reads each interval's observation before it is asked (the fallback)."""

    def note(self, observation: Observation) -> None: ...


class Holt:
    """Holt's linear trend forecast of one series, one step ahead."""

    def __init__(self, alpha: float, beta: float) -> None:
        self.alpha, self.beta = alpha, beta
        self.level: float | None = None
        self.trend = 0.0

    def update(self, value: float) -> float:
        if self.level is None:
            self.level = value
        else:
            last = self.level
            self.level = self.alpha * value + (1 - self.alpha) * (last + self.trend)
            self.trend = self.beta * (self.level - last) + (1 - self.beta) * self.trend
        return max(0.0, self.level + self.trend)


@dataclass(frozen=True, slots=True)
class Decision:
    """What the planner did for one role in one interval. `action`: up, down or hold;
    `reason`: a label (advice, pending, cooldown, steady, retry_start, start_failed)."""
    role: str
    action: str
    current: int
    target: int
    reason: str
    detail: str = ""


@dataclass(slots=True)
class _RoleState:
    streak: int = 0  # consecutive intervals asking to move the same way; sign = direction
    changed_at: float = float("-inf")
    failed_seen: int = 0  # the scaler's failed_starts at the last look
    num_failures: int = 0  # consecutive failed starts (back-off exponent)
    retry_at: float | None = None


class LivePlanner:
    """One planner over one deployment. `sample()` reads the router (`RouterScrape.sample`);
    `clock` is injectable for tests; `metrics`: a `PlannerMetrics` (or anything with its
    methods)."""

    def __init__(self, advisor: Advisor, scaler: Scaler, sample: Callable[[], Sample], slo: Slo, limits: Limits,
                 config: LiveConfig = LiveConfig(), metrics=None, clock: Callable[[], float] = time.monotonic) -> None:
        from pdserve.planner.metrics import NullPlannerMetrics

        self.advisor, self.scaler, self.slo, self.limits, self.config = advisor, scaler, slo, limits, config
        self._sample = sample
        self._clock = clock
        self.metrics = metrics or NullPlannerMetrics()
        self._forecast = Holt(config.alpha, config.beta)
        self._last: Sample | None = None
        self._load: WorkloadStats | None = None
        self._roles = {role: _RoleState() for role in scaler.roles()}
        self.last_advice: Advice | None = None

    def bounds(self, role: str) -> tuple[int, int]:
        """(min, max) workers of `role`: the limits, and at least one of a role the deployment runs."""
        low = self.limits.min_prefill if role == "prefill" else self.limits.min_decode
        high = self.limits.max_prefill if role == "prefill" else self.limits.max_decode
        return max(low, 1), max(high, low, 1)

    def tick(self) -> list[Decision]:
        """One interval: observe, forecast, advise, decide. The first call only takes a sample."""
        now = self._clock()
        sample = self._sample()
        before, self._last = self._last, sample
        counts = self.scaler.counts()
        decisions = self._retries(counts, now)
        if before is None:
            return decisions
        seen = observe(before, sample, self.slo, self._load)
        self._load = seen.load
        load = WorkloadStats(self._forecast.update(seen.load.request_rate), seen.load.mean_input_len,
                             seen.load.mean_output_len)
        if isinstance(self.advisor, ObservingAdvisor):
            self.advisor.note(seen)
        advice = self.last_advice = self.advisor.advise(load, self.slo, self.limits)
        self.metrics.observed(seen, load, advice)
        wants = {"prefill": advice.shape.num_prefill, "decode": advice.shape.num_decode}
        for role, state in self._roles.items():
            if state.retry_at is None:
                decisions.append(self._decide(role, state, counts[role], wants[role], advice, now))
        for d in decisions:
            self._report(d, counts.get(d.role))
        return decisions

    def _decide(self, role: str, state: _RoleState, count: RoleCount, want: int, advice: Advice,
                now: float) -> Decision:
        low, high = self.bounds(role)
        want = min(max(want, low), high)
        current = count.target
        direction = (want > current) - (want < current)
        if direction == 0:
            state.streak = 0
            return Decision(role, "hold", current, current, "steady", advice.reason)
        state.streak = state.streak + direction if state.streak * direction > 0 else direction
        if abs(state.streak) < self.config.agree_intervals:
            return Decision(role, "hold", current, want, "pending",
                            f"{abs(state.streak)} of {self.config.agree_intervals} intervals agree; {advice.reason}")
        cooldown = self.config.cooldown_up_s if direction > 0 else self.config.cooldown_down_s
        if now - state.changed_at < cooldown:
            return Decision(role, "hold", current, want, "cooldown",
                            f"last change {now - state.changed_at:.0f} s ago, cool-down {cooldown:g} s")
        target = want if direction > 0 else current - 1
        state.streak, state.changed_at = 0, now
        action = "up" if direction > 0 else "down"
        self.scaler.set_target(role, target, advice.reason)
        return Decision(role, action, current, target, "advice", advice.reason)

    def _retries(self, counts: Mapping[str, RoleCount], now: float) -> list[Decision]:
        """Failed starts since the last look: report, schedule a retry; ask again when due."""
        out = []
        for role, state in self._roles.items():
            count = counts[role]
            if count.failed_starts > state.failed_seen:
                state.num_failures += count.failed_starts - state.failed_seen
                state.failed_seen = count.failed_starts
                delay = min(self.config.max_backoff_s, self.config.backoff_s * 2 ** (state.num_failures - 1))
                state.retry_at = now + delay
                self.metrics.failed_start(role)
                out.append(Decision(role, "hold", count.target, count.target, "start_failed",
                                    f"{count.last_failure or 'a start failed'}; retry in {delay:g} s"))
            elif state.retry_at is not None and now >= state.retry_at:
                state.retry_at = None
                self.scaler.set_target(role, count.target, "retry after a failed start")
                out.append(Decision(role, "up", count.ready + count.starting, count.target, "retry_start",
                                    f"attempt {state.num_failures + 1}"))
            elif state.retry_at is None and count.ready >= count.target:
                state.num_failures = 0
        return out

    def _report(self, d: Decision, count: RoleCount | None) -> None:
        self.metrics.decided(d, count)
        line = f"planner: {d.role} {d.action} {d.current} -> {d.target} ({d.reason}: {d.detail})"
        (log.debug if d.reason == "steady" else log.info)(line)

    def run(self, stop: threading.Event) -> None:
        """Tick every interval until `stop` is set; a failed tick is logged and the loop goes on."""
        while not stop.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a router that does not answer costs one interval
                log.exception("planner: this interval's tick failed")
            stop.wait(self.config.interval_s)


@dataclass(slots=True)
class RecordedMetrics:
    """Replays recorded `Sample`s, one per `sample()` call (tests; `pdserve plan` replays)."""
    samples: list[Sample]
    taken: list[Sample] = field(default_factory=list)

    def __call__(self) -> Sample:
        sample = self.samples[len(self.taken)]
        self.taken.append(sample)
        return sample

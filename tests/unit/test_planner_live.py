"""The live planner's decisions on recorded metrics: a sequence of router metric samples in,
scale decisions out (hysteresis, limits, cool-down, a failed start retried with back-off), and
what it reads off a real router's /metrics."""
from __future__ import annotations

import math

import pytest

from pdserve.planner.fallback import ThresholdAdvisor, ThresholdRules
from pdserve.planner.live import Holt, LiveConfig, LivePlanner, RecordedMetrics
from pdserve.planner.metrics import PlannerMetrics
from pdserve.planner.observe import Sample, observe, parse
from pdserve.planner.scalers import RoleCount
from pdserve.planner.types import Advice, Limits, Shape, Slo

SLO = Slo(ttft_ms=500, tpot_ms=50)
INTERVAL = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeScaler:
    """Workers become ready at the next look, except the next `fail` starts of a role."""

    def __init__(self, prefill: int = 1, decode: int = 1) -> None:
        self.count = {"prefill": RoleCount(prefill, prefill), "decode": RoleCount(decode, decode)}
        self.fail = {"prefill": 0, "decode": 0}
        self.calls: list[tuple[str, int]] = []

    def roles(self):
        return ("prefill", "decode")

    def counts(self):
        return dict(self.count)

    def set_target(self, role: str, count: int, reason: str) -> None:
        self.calls.append((role, count))
        c = self.count[role]
        if count > c.ready and self.fail[role]:
            self.fail[role] -= 1
            self.count[role] = RoleCount(count, c.ready, failed_starts=c.failed_starts + 1,
                                         last_failure="decode-9 exited with status 1 before it was ready")
        else:
            self.count[role] = RoleCount(count, count, failed_starts=c.failed_starts)


class Scripted:
    """An advisor that answers the shapes it is given, one per interval (the last one repeats)."""

    def __init__(self, *shapes: tuple[int, int]) -> None:
        self.shapes = list(shapes)
        self.asked = 0

    def advise(self, load, slo, limits):
        p, d = self.shapes[min(self.asked, len(self.shapes) - 1)]
        self.asked += 1
        return Advice(Shape(p, d), True, f"scripted {p}p{d}d")


def recorded(rates: list[float], latency_s: float = 1.0) -> RecordedMetrics:
    """Cumulative router samples, one per interval, with these arrival rates (every request
    finishing within its interval, 100 prompt and 20 answer tokens each, all within the SLO)."""
    samples, finished = [Sample(0.0)], 0.0
    for i, rate in enumerate(rates, start=1):
        finished += rate * INTERVAL
        samples.append(Sample(i * INTERVAL, num_finished=finished, prompt_tokens=100 * finished,
                              completion_tokens=20 * finished, latency_sum_s=latency_s * finished,
                              latency_count=finished, ttft_buckets=((0.25, finished), (math.inf, finished)),
                              itl_buckets=((0.04, 20 * finished), (math.inf, 20 * finished)),
                              num_alive={"prefill": 1, "decode": 1}))
    return RecordedMetrics(samples)


def run(planner: LivePlanner, clock: Clock, n: int) -> list[list]:
    out = []
    for _ in range(n):
        out.append(planner.tick())
        clock.now += INTERVAL
    return out


def planner_of(advisor, scaler, samples, limits=Limits(1, 4, 1, 4), **config) -> tuple[LivePlanner, Clock]:
    clock = Clock()
    cfg = LiveConfig(interval_s=INTERVAL, agree_intervals=2, cooldown_up_s=30, cooldown_down_s=40, backoff_s=5,
                     max_backoff_s=20, **config)
    return LivePlanner(advisor, scaler, samples, SLO, limits, cfg, PlannerMetrics(), clock), clock


def test_one_interval_of_advice_changes_nothing_two_agreeing_do():
    scaler = FakeScaler()
    planner, clock = planner_of(Scripted((1, 3), (1, 1), (1, 3), (1, 3)), scaler, recorded([1] * 6))
    ticks = run(planner, clock, 5)
    decode = [d for tick in ticks for d in tick if d.role == "decode"]
    assert [(d.action, d.reason) for d in decode] == [("hold", "pending"), ("hold", "steady"),
                                                      ("hold", "pending"), ("up", "advice")]
    assert scaler.calls == [("decode", 3)]  # growth goes straight to the advice
    assert decode[-1].current == 1 and decode[-1].target == 3


def test_advice_is_clamped_to_limits_and_never_below_one_worker_per_role():
    scaler = FakeScaler(prefill=1, decode=2)
    planner, clock = planner_of(Scripted((9, 9)), scaler, recorded([1] * 4), limits=Limits(0, 2, 0, 3))
    run(planner, clock, 3)
    assert scaler.count["decode"].target == 3 and scaler.count["prefill"].target == 2
    scaler = FakeScaler(prefill=1, decode=1)
    planner, clock = planner_of(Scripted((0, 1)), scaler, recorded([0] * 6), limits=Limits(0, 2, 0, 3))
    decisions = [d for tick in run(planner, clock, 6) for d in tick]
    assert scaler.calls == [] and all(d.reason == "steady" for d in decisions)  # 0 prefill is below the floor


def test_cool_down_holds_a_second_change_and_shrinking_drains_one_at_a_time():
    scaler = FakeScaler(decode=1)
    advice = [(1, 2), (1, 2), (1, 4), (1, 4), (1, 4), (1, 1), (1, 1), (1, 1), (1, 1), (1, 1), (1, 1), (1, 1)]
    planner, clock = planner_of(Scripted(*advice), scaler, recorded([1] * 20))
    ticks = run(planner, clock, 18)
    decode = [(d.action, d.reason, d.target) for tick in ticks for d in tick if d.role == "decode"]
    assert decode[:5] == [("hold", "pending", 2), ("up", "advice", 2), ("hold", "pending", 4),
                          ("hold", "cooldown", 4), ("up", "advice", 4)]
    # down: agreed at once, but 40 s of cool-down from the last change; then one worker per change
    assert ("down", "advice", 3) in decode and ("down", "advice", 2) in decode
    assert [c for c in scaler.calls if c[0] == "decode"][:4] == [("decode", 2), ("decode", 4), ("decode", 3),
                                                                 ("decode", 2)]
    downs = [i for i, d in enumerate(decode) if d[0] == "down"]
    assert downs[1] - downs[0] >= 4  # 40 s apart


def test_a_failed_start_is_reported_not_counted_and_retried_with_back_off():
    scaler = FakeScaler(decode=1)
    scaler.fail["decode"] = 2
    metrics = PlannerMetrics()
    planner, clock = planner_of(Scripted((1, 2)), scaler, recorded([1] * 14))
    planner.metrics = metrics
    seen = []
    for _ in range(12):
        seen.append((clock.now, [(d.action, d.reason) for d in planner.tick() if d.role == "decode"]))
        assert scaler.count["decode"].ready <= 2
        clock.now += 2.5  # finer than the interval: the back-off is in seconds
    flat = [(t, a) for t, tick in seen for a in tick]
    failed = [t for t, a in flat if a == ("hold", "start_failed")]
    retried = [t for t, a in flat if a == ("up", "retry_start")]
    assert len(failed) == 2 and len(retried) == 2
    assert retried[0] - failed[0] == pytest.approx(5.0) and retried[1] - failed[1] == pytest.approx(10.0)
    assert scaler.count["decode"] == RoleCount(2, 2, failed_starts=2)  # the third start took
    text = metrics.render().decode()
    assert 'pdserve_planner_failed_starts_total{role="decode"} 2.0' in text
    assert 'pdserve_planner_decisions_total{action="up",reason="retry_start",role="decode"} 2.0' in text


def test_holt_follows_a_trend():
    holt = Holt(0.6, 0.3)
    forecasts = [holt.update(v) for v in (1, 2, 3, 4, 5)]
    assert forecasts[-1] > 5  # a rising series is forecast higher than its last value
    assert Holt(0.6, 0.3).update(0.0) == 0.0 and min(Holt(0.6, 0.3).update(v) for v in (5, 0, 0, 0)) >= 0


def test_observe_reads_a_real_router_registry():
    from prometheus_client import generate_latest

    from pdserve.router.metrics import RouterMetrics

    metrics = RouterMetrics()
    before = parse(generate_latest(metrics.registry).decode(), at=0.0)
    for ttft in (0.1, 0.2, 0.3, 2.0):
        metrics.requests.labels("chat", "ok").inc()
        metrics.ttft.observe(ttft)
        metrics.e2e.observe(ttft + 1.0)
    metrics.requests.labels("chat", "unavailable").inc()
    metrics.prompt_tokens.labels("computed").inc(400)
    metrics.prompt_tokens.labels("cached").inc(100)
    metrics.completion_tokens.inc(50)
    for gap in (0.01, 0.02, 0.03, 0.2):
        metrics.inter_token.observe(gap)
    after = parse(generate_latest(metrics.registry).decode(), at=10.0)
    seen = observe(before, after, Slo(ttft_ms=500, tpot_ms=40))
    assert seen.load.request_rate == pytest.approx(0.5)
    assert seen.load.mean_input_len == pytest.approx(100) and seen.load.mean_output_len == pytest.approx(10)
    assert seen.num_failed == 1 and seen.num_finished == 5
    assert seen.ttft_attainment == pytest.approx(0.75) and seen.tpot_attainment == pytest.approx(0.75)
    assert seen.mean_latency_s == pytest.approx(1.65)


def test_threshold_fallback_grows_with_the_load_and_shrinks_after_it():
    scaler = FakeScaler(prefill=1, decode=1)
    advisor = ThresholdAdvisor(ThresholdRules(streams_per_decode=2))
    rates = [0.5] * 3 + [5.0] * 6 + [0.5] * 12
    planner, clock = planner_of(advisor, scaler, recorded(rates, latency_s=1.0), limits=Limits(1, 2, 1, 3))
    history = []
    for _ in range(len(rates)):
        planner.tick()
        history.append(scaler.count["decode"].target)
        clock.now += INTERVAL
    assert max(history) == 3 and history[-1] == 1  # 5 req/s x 1 s = 5 streams -> 3; then back to 1
    assert history.index(3) >= 4  # not before two intervals of high load agreed


def test_the_fallback_counts_streams_in_flight_when_none_finished():
    from dataclasses import replace

    samples = recorded([0.2] * 4).samples
    long = [replace(s, num_in_flight=6.0) for s in samples]  # six long answers, none ending
    scaler = FakeScaler(prefill=1, decode=1)
    planner, clock = planner_of(ThresholdAdvisor(ThresholdRules(streams_per_decode=2)), scaler,
                                RecordedMetrics(long), limits=Limits(1, 2, 1, 4))
    run(planner, clock, 4)
    assert scaler.count["decode"].target == 3

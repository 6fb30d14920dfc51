"""The live planner's Prometheus metrics, on a registry of its own: what it observed and
forecast, what it wants, what each role runs, and every decision with its reason."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class PlannerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.workers = Gauge("pdserve_planner_workers", "Workers per role: desired (the advice within limits), "
                             "target (what the scaler moves to), ready, starting, draining", ("role", "state"),
                             registry=r)
        self.decisions = Counter("pdserve_planner_decisions_total", "The planner's decisions by role, action "
                                 "(up, down, hold) and reason", ("role", "action", "reason"), registry=r)
        self.failed_starts = Counter("pdserve_planner_failed_starts_total", "Worker starts that failed (retried "
                                     "with back-off, never counted as capacity)", ("role",), registry=r)
        self.rate = Gauge("pdserve_planner_request_rate", "Arrivals per second: observed last interval and "
                          "forecast for the next", ("kind",), registry=r)
        self.attainment = Gauge("pdserve_planner_slo_attainment", "Share of the last interval's TTFT and "
                                "inter-token gaps within the SLO", ("slo",), registry=r)
        self.meets_slo = Gauge("pdserve_planner_advice_meets_slo", "1 while the advisor's shape is predicted to "
                               "meet the SLO", registry=r)

    def observed(self, seen, load, advice) -> None:
        self.rate.labels("observed").set(seen.load.request_rate)
        self.rate.labels("forecast").set(load.request_rate)
        self.attainment.labels("ttft").set(seen.ttft_attainment)
        self.attainment.labels("tpot").set(seen.tpot_attainment)
        self.meets_slo.set(1 if advice.meets_slo else 0)

    def decided(self, decision, count) -> None:
        self.decisions.labels(decision.role, decision.action, decision.reason).inc()
        self.workers.labels(decision.role, "desired").set(decision.target)
        if count is not None:
            for state in ("target", "ready", "starting", "draining"):
                self.workers.labels(decision.role, state).set(getattr(count, state))

    def failed_start(self, role: str) -> None:
        self.failed_starts.labels(role).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class NullPlannerMetrics:
    """No metrics (a planner in a test that does not read them)."""

    def observed(self, seen, load, advice) -> None:
        pass

    def decided(self, decision, count) -> None:
        pass

    def failed_start(self, role: str) -> None:
        pass

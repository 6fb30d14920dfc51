"""Puts a live planner together and runs it on a thread of its own: the router it reads, the
advisor it asks, the scaler it drives, its metrics listener. `pdserve up --planner` gives it
the process scaler; `pdserve planner` (the chart's component) the Kubernetes one."""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable

from pdserve.planner.live import LivePlanner
from pdserve.planner.observe import RouterScrape
from pdserve.planner.scalers import Scaler
from pdserve.planner.settings import PlannerSettings
from pdserve.planner.types import Advice, Advisor, Limits, Slo, WorkloadStats

log = logging.getLogger("pdserve.planner")


def default_advisor(settings: PlannerSettings) -> Advisor:
    """The advisor a planner asks unless given one: the simulator over `--planner-profile`
    (`planner.search.SimulatedAdvisor`), else the rule-based fallback (`planner.fallback`).
    A profile not written yet (the chart's profile Job still measuring) is waited for: the
    fallback advises until it is there (`ProfileWhenWritten`)."""
    from pdserve.planner.fallback import ThresholdAdvisor, ThresholdRules

    fallback = ThresholdAdvisor(ThresholdRules(streams_per_decode=settings.planner_streams_per_decode))
    if not settings.planner_profile:
        return fallback
    if not os.path.exists(settings.planner_profile):
        log.info("planner: no profile at %s yet; the fallback advises until one is written",
                 settings.planner_profile)
        return ProfileWhenWritten(settings.planner_profile, fallback)
    from pdserve.planner.profile import load_profile
    from pdserve.planner.search import SimulatedAdvisor

    return SimulatedAdvisor(load_profile(settings.planner_profile))


class ProfileWhenWritten:
    """The fallback's advice until a profile appears at `path`, the simulator's from then on.
    A profile that appears but does not load is logged (once per error) and looked at again
    next time; the fallback keeps advising meanwhile."""

    def __init__(self, path: str, fallback: Advisor) -> None:
        self.path, self.fallback = path, fallback
        self.advisor: Advisor | None = None
        self._last_error = ""

    @property
    def name(self) -> str:
        return getattr(self.advisor or self.fallback, "name", "")

    def advise(self, load: WorkloadStats, slo: Slo, limits: Limits) -> Advice:
        if self.advisor is None and os.path.exists(self.path):
            from pdserve.planner.profile import ProfileError, load_profile
            from pdserve.planner.search import SimulatedAdvisor

            try:
                self.advisor = SimulatedAdvisor(load_profile(self.path))
                log.info("planner: profile %s loaded; the simulator advises from now on", self.path)
            except ProfileError as exc:
                if str(exc) != self._last_error:
                    log.error("planner: %s; the fallback keeps advising", exc)
                    self._last_error = str(exc)
        return (self.advisor or self.fallback).advise(load, slo, limits)


class RunningPlanner:
    """A `LivePlanner` ticking on its own thread until `stop()`; its /metrics served when asked."""

    def __init__(self, settings: PlannerSettings, scaler: Scaler, router_url: str, api_key: str = "",
                 advisor: Advisor | None = None, host: str = "127.0.0.1") -> None:
        from pdserve.planner.metrics import PlannerMetrics

        self.metrics = PlannerMetrics()
        self.planner = LivePlanner(advisor or default_advisor(settings), scaler,
                                   RouterScrape(router_url, api_key).sample, settings.slo(), settings.limits(),
                                   settings.live_config(), self.metrics)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.planner.run, args=(self._stop,), name="planner", daemon=True)
        self._server = None
        if settings.planner_metrics_port:
            from pdserve.common.metrics_http import MetricsServer

            self._server = MetricsServer(host, settings.planner_metrics_port, self.metrics.render)

    def start(self) -> "RunningPlanner":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        if self._server is not None:
            self._server.shutdown()


def log_to(say: Callable[[str], None], level: int = logging.INFO) -> None:
    """The planner's log lines go to `say` (a launcher's own output)."""

    class _Say(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            say(self.format(record))

    handler = _Say(level)
    handler.setFormatter(logging.Formatter("%(message)s"))
    planner_log = logging.getLogger("pdserve.planner")
    planner_log.addHandler(handler)
    planner_log.setLevel(level)
    planner_log.propagate = False

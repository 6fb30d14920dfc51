"""The live planner's settings: the one table of its flags (`pdserve up --planner ...` and
`pdserve planner ...`, the chart's planner component), typed and checked once."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from pdserve.common.errors import InvalidRequestError
from pdserve.common.flags import setting
from pdserve.common.values import coerce
from pdserve.planner.live import LiveConfig
from pdserve.planner.types import Limits, Slo

BOTH = ("up", "planner")  # `up --planner` and the cluster's `pdserve planner`


def _opt(default: Any, help: str, group: str = "planner", roles: tuple = BOTH) -> Any:
    return setting(default, help, group, roles=roles)


@dataclass(frozen=True, slots=True)
class PlannerSettings:
    planner: bool = _opt(False, "scale prefill and decode workers to the SLO while serving (the live planner)",
                         roles=("up",))
    slo_ttft_ms: float = _opt(2000.0, "planner: the time-to-first-token target, ms")
    slo_tpot_ms: float = _opt(200.0, "planner: the time-per-output-token target, ms")
    slo_attainment: float = _opt(0.9, "planner: share of requests that must meet both targets")
    planner_interval_s: float = _opt(10.0, "planner: seconds between two looks at the router's metrics")
    planner_agree_intervals: int = _opt(2, "planner: consecutive intervals that must ask for a change")
    planner_cooldown_up_s: float = _opt(20.0, "planner: no growth of a role this soon after its last change")
    planner_cooldown_down_s: float = _opt(40.0, "planner: no removal from a role this soon after its last change")
    planner_min_prefill: int = _opt(1, "planner: fewest prefill workers (at least 1 while the deployment has any)")
    planner_max_prefill: int = _opt(2, "planner: most prefill workers")
    planner_min_decode: int = _opt(1, "planner: fewest decode workers (at least 1)")
    planner_max_decode: int = _opt(2, "planner: most decode workers")
    planner_streams_per_decode: float = _opt(8.0, "planner's fallback advisor: open streams one decode worker "
                                             "carries before another is wanted")
    planner_profile: str = _opt("", "planner: a `pdserve profile` JSON of this model and device; the simulator "
                                "then chooses the shape (without one, the fallback's thresholds do)")
    planner_metrics_port: int = _opt(0, "planner: serve its Prometheus /metrics on this port (0: off)")
    router_url: str = _opt("http://127.0.0.1:8000", "planner: the router's HTTP address, whose /metrics it reads",
                           "kubernetes", ("planner",))
    api_key: str = _opt("", "planner: the router's API key, when its /metrics asks for one (prefer "
                        "PDSERVE_API_KEY: flags show in ps)", "kubernetes", ("planner",))
    namespace: str = _opt("default", "planner: the namespace of the worker Deployments", "kubernetes", ("planner",))
    prefill_deployment: str = _opt("pdserve-prefill", "planner: the prefill workers' Deployment", "kubernetes",
                                   ("planner",))
    decode_deployment: str = _opt("pdserve-decode", "planner: the decode workers' Deployment", "kubernetes",
                                  ("planner",))

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> "PlannerSettings":
        values = {}
        for f in fields(cls):
            if settings.get(f.name) is None:
                continue
            try:
                values[f.name] = coerce(settings[f.name], f.default)
            except (TypeError, ValueError):
                raise InvalidRequestError(f"--{f.name.replace('_', '-')}: cannot use {settings[f.name]!r}") from None
        out = cls(**values)
        out.limits()
        if out.slo_ttft_ms <= 0 or out.slo_tpot_ms <= 0 or not 0 < out.slo_attainment <= 1:
            raise InvalidRequestError("--slo-ttft-ms and --slo-tpot-ms must be > 0, --slo-attainment in (0, 1]")
        if out.planner_interval_s <= 0 or out.planner_agree_intervals < 1 or out.planner_streams_per_decode <= 0:
            raise InvalidRequestError("--planner-interval-s and --planner-streams-per-decode must be > 0, "
                                      "--planner-agree-intervals >= 1")
        return out

    def slo(self) -> Slo:
        return Slo(self.slo_ttft_ms, self.slo_tpot_ms, attainment=self.slo_attainment)

    def limits(self) -> Limits:
        """InvalidRequestError for a min over its max or under one."""
        for role in ("prefill", "decode"):
            low, high = getattr(self, f"planner_min_{role}"), getattr(self, f"planner_max_{role}")
            if low < 0 or high < max(1, low):
                raise InvalidRequestError(f"--planner-min-{role} {low} / --planner-max-{role} {high}: need "
                                          "0 <= min <= max and max >= 1")
        return Limits(self.planner_min_prefill, self.planner_max_prefill, self.planner_min_decode,
                      self.planner_max_decode)

    def live_config(self) -> LiveConfig:
        return LiveConfig(interval_s=self.planner_interval_s, agree_intervals=self.planner_agree_intervals,
                          cooldown_up_s=self.planner_cooldown_up_s, cooldown_down_s=self.planner_cooldown_down_s)

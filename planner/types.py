"""The values the planner's parts exchange: what a deployment looks like, what load it must
carry, what it must meet, and the seam between the live planner and the simulator.

The live planner (`planner/live.py`) never simulates itself: it observes, forecasts and asks
an `Advisor`, then moves worker counts toward the advice within its limits. The simulator-backed
advisor lives beside the search (`planner/search.py`); tests may give the live planner any
other `Advisor`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Shape:
    """A deployment's shape: colocated (decode services prefill their own prompts; no prefill
    workers) or xPyD. `config` names it as `plan --json` does: `colocated`, `1p1d`, `2p1d`..."""
    num_prefill: int
    num_decode: int

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(f"a shape needs at least one decode and no negative count: {self}")

    @property
    def colocated(self) -> bool:
        return self.num_prefill == 0

    @property
    def config(self) -> str:
        return "colocated" if self.colocated else f"{self.num_prefill}p{self.num_decode}d"


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    """The load of one interval, observed or forecast: Poisson-like arrivals at
    `request_rate` per second, with these mean prompt and answer lengths in tokens."""
    request_rate: float
    mean_input_len: float
    mean_output_len: float


@dataclass(frozen=True, slots=True)
class Slo:
    """Targets: `percentile` of TTFT and of TPOT under their bounds for at least
    `attainment` of requests (a fraction in (0, 1])."""
    ttft_ms: float
    tpot_ms: float
    percentile: float = 90.0
    attainment: float = 0.9


@dataclass(frozen=True, slots=True)
class Advice:
    """What to run for a load, and why: `bound` names the phase that limits it
    (`prefill`, `decode`, `transfer`, `none`); `meets_slo` is False when no shape within
    the limits meets the SLO (then `shape` is the nearest)."""
    shape: Shape
    meets_slo: bool
    reason: str
    bound: str = "none"


@dataclass(frozen=True, slots=True)
class Limits:
    """Worker counts the live planner may choose between, per role (inclusive)."""
    min_prefill: int = 0
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4


class Advisor(Protocol):
    """Answers: which shape within `limits` best serves `load` under `slo`?"""

    def advise(self, load: WorkloadStats, slo: Slo, limits: Limits) -> Advice: ...

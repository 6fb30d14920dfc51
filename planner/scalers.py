"""How worker counts change: the `Scaler` seam between the live planner and the machinery that
starts and stops workers (processes under `pdserve up` in `pdserve.deploy.scaler`; Deployments
in Kubernetes, `planner.kube`). The planner never imports either: it is handed a `Scaler`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol


@dataclass(frozen=True, slots=True)
class RoleCount:
    """One role's workers as the scaler sees them now.

    `target`: the count it was last asked for. `ready`: serving (the only ones that count as
    capacity). `starting`: launched, not ready yet. `draining`: being removed (no new work;
    finishing their own). `failed_starts`: starts that failed since the scaler began (a
    cumulative counter: the planner compares it between intervals)."""
    target: int
    ready: int
    starting: int = 0
    draining: int = 0
    failed_starts: int = 0
    last_failure: str = ""


class Scaler(Protocol):
    """Moves each role's worker count toward a target.

    Contract: `set_target(role, n)` returns at once; the scaler starts workers until
    `ready + starting == n` and drains the surplus (a drained worker takes no new work and
    exits once its own work is done or its deadline passed; nothing in flight is lost). A
    start that fails is not retried by the scaler: it shows in `failed_starts`, and the
    planner asks again (`set_target` with the same count) after its back-off. `counts()` is
    cheap and never raises for a role it manages."""

    def roles(self) -> tuple[str, ...]:
        """The roles this scaler manages (`prefill`, `decode`)."""

    def counts(self) -> Mapping[str, RoleCount]:
        """Every managed role's `RoleCount` now."""

    def set_target(self, role: str, count: int, reason: str) -> None:
        """Move `role` toward `count` workers; `reason` goes to the scaler's own log."""

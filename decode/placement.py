"""Where this request's prompt is prefilled. The router decides local vs remote (it knows
every worker's cache and queue); decode overrules it only when it cannot take a remote
prefill at all."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Placement:
    remote: bool
    reason: str  # goes into the verdict, logs and metrics


def place(prefill_address: str, router_reason: str, can_receive: bool) -> Placement:
    if not prefill_address:
        return Placement(False, router_reason or "no_prefill_worker")
    if not can_receive:
        return Placement(False, "no_transfer_backend")
    return Placement(True, router_reason or "remote")

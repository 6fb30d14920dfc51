"""How many intra-op threads the engine's steps take: a knob the engine obeys on its own
thread, turned by a policy that lives outside it (the worker's, `pdserve.worker.core_share`).

The engine asks its policy before each step (`step_threads`, with whether the step runs a
forward) and, while a step runs on more than its base count, before each layer of the
forward (`layer_threads`), and sets torch's count when the answer changes.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch


class ThreadPolicy(Protocol):
    """Decides the engine's step thread count. Called on the engine thread only; each call
    must be cheap (it runs before every step, and between layers of a burst step)."""

    def step_threads(self, forward: bool) -> int:
        """The count for the step about to run; `forward` is False when the engine has
        nothing to compute (idle, or every request waits outside it)."""

    def layer_threads(self) -> int | None:
        """Within a step that runs above its base count, before each layer: a new count,
        or None to keep the current one."""


class FixedThreads:
    """The null policy: every step takes the base count."""

    def __init__(self, base: int) -> None:
        self.base = base

    def step_threads(self, forward: bool) -> int:
        return self.base

    def layer_threads(self) -> int | None:
        return None


class StepThreads:
    """The engine's side: torch's thread count, set as its policy answers."""

    def __init__(self, num_threads: int | None, policy: ThreadPolicy | None = None) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.base = self.current = torch.get_num_threads()
        self.policy = policy or FixedThreads(self.base)

    def before_step(self, forward: bool) -> Callable[[], None] | None:
        """Before a step; returns the hook its forward runs before each layer when the step
        runs above the base count, else None (every other step checks nothing per layer).
        A step with nothing to compute only tells the policy: the count stays as it was."""
        wanted = self.policy.step_threads(forward)
        if not forward:
            return None
        self._set(wanted)
        return self._between_layers if self.current > self.base else None

    def _between_layers(self) -> None:
        wanted = self.policy.layer_threads()
        if wanted is not None:
            self._set(wanted)

    def _set(self, wanted: int) -> None:
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted

"""Health of one backend: a small circuit breaker.

healthy --(failure_threshold failures in a row)--> unhealthy
unhealthy --(cooldown_s passed)--> probe due: the next call is a probe (a cheap call, or the
                                   real one for transports); success -> healthy,
                                   failure -> unhealthy again for another cool-down.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    failure_threshold: int = 3
    cooldown_s: float = 5.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.cooldown_s < 0:
            raise ValueError("failure_threshold must be >= 1 and cooldown_s >= 0")


class BackendHealth:
    """Thread-safe. `clock` is injectable for tests (defaults to time.monotonic)."""

    def __init__(self, name: str, policy: HealthPolicy = HealthPolicy(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.policy = policy
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._down_since: float | None = None
        self.last_error = ""

    @property
    def is_healthy(self) -> bool:
        with self._lock:
            return self._down_since is None

    @property
    def num_consecutive_failures(self) -> int:
        with self._lock:
            return self._failures

    def can_try(self) -> bool:
        """True when healthy, or unhealthy with the cool-down over (the call is then a probe)."""
        with self._lock:
            return (self._down_since is None
                    or self._clock() - self._down_since >= self.policy.cooldown_s)

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            self._down_since = None
            self.last_error = ""

    def record_failure(self, reason: str) -> None:
        with self._lock:
            self._failures += 1
            self.last_error = reason
            if self._down_since is not None or self._failures >= self.policy.failure_threshold:
                self._down_since = self._clock()  # (re)start the cool-down

    def skip_reason(self) -> str:
        with self._lock:
            return (f"unhealthy after {self._failures} failures in a row "
                    f"(last: {self.last_error or 'unknown'}); probe after {self.policy.cooldown_s:g}s")

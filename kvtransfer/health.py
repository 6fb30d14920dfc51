"""Health of one backend: a small circuit breaker.

healthy --(failure_threshold failures in a row)--> unhealthy
unhealthy --(cooldown_s passed)--> probe due: the next call is a probe (a cheap call, or the
                                   real one for transports); success -> healthy,
                                   failure -> unhealthy again for another cool-down.

A backend with a cheap, bounded probe of its own (a store's PING under its socket timeout)
may be probed in the background instead: while unhealthy it is never tried (`can_try` is
False, so no request waits on a dead server and its state reads unusable), and a thread of
this object runs the probe every cool-down until one succeeds.
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
    """Thread-safe. `clock` is injectable for tests (defaults to time.monotonic). `probe`: the
    backend's own probe, run in the background while unhealthy (it records its outcome here);
    None: probed by the next call after the cool-down. `close` stops the background probe."""

    def __init__(self, name: str, policy: HealthPolicy = HealthPolicy(),
                 clock: Callable[[], float] = time.monotonic, probe: Callable[[], bool] | None = None) -> None:
        self.name = name
        self.policy = policy
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._down_since: float | None = None
        self.last_error = ""
        self._probe = probe
        self._prober: threading.Thread | None = None  # set while a background probe runs
        self._closed = threading.Event()

    @property
    def is_healthy(self) -> bool:
        with self._lock:
            return self._down_since is None

    @property
    def is_probing(self) -> bool:
        """A background probe runs (it ends once the backend is healthy or this is closed)."""
        with self._lock:
            return self._prober is not None

    @property
    def num_consecutive_failures(self) -> int:
        with self._lock:
            return self._failures

    def can_try(self) -> bool:
        """True when healthy, or (probed by use) unhealthy with the cool-down over: the call is
        then a probe."""
        with self._lock:
            return (self._down_since is None
                    or (self._probe is None and self._clock() - self._down_since >= self.policy.cooldown_s))

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
            prober = None
            if self._down_since is not None and self._probe is not None and self._prober is None \
                    and not self._closed.is_set():
                prober = self._prober = threading.Thread(target=self._probe_until_healthy, daemon=True,
                                                         name=f"probe-{self.name}")
        if prober is not None:
            prober.start()

    def _probe_until_healthy(self) -> None:
        """Every cool-down (real time), the probe, until the backend is healthy or this health
        is closed."""
        while not self._closed.wait(self.policy.cooldown_s):
            try:
                self._probe()
            except Exception as exc:  # noqa: BLE001 - a probe's bug must not end the probing
                self.record_failure(f"probe: {exc.__class__.__name__}: {exc}")
            with self._lock:
                if self._down_since is None:
                    self._prober = None  # under the lock of record_failure: a later failure probes anew
                    return
        with self._lock:
            self._prober = None

    def close(self) -> None:
        """Stops the background probe (at its next wake-up). Idempotent."""
        self._closed.set()

    def skip_reason(self) -> str:
        with self._lock:
            when = "probed every" if self._probe is not None else "probe after"
            return (f"unhealthy after {self._failures} failures in a row "
                    f"(last: {self.last_error or 'unknown'}); {when} {self.policy.cooldown_s:g}s")

"""A backend's health with a background probe: while unhealthy it is never tried, a thread
probes it every cool-down until the backend answers, and closing stops the probing."""
from __future__ import annotations

import threading
import time

from pdserve.kvtransfer.health import BackendHealth, HealthPolicy

COOLDOWN_S = 0.05


class SwitchedProbe:
    """A probe that fails until `answering` is set; it records its outcome as a store's does."""

    def __init__(self) -> None:
        self.health: BackendHealth | None = None
        self.answering = threading.Event()
        self.num_calls = 0

    def __call__(self) -> bool:
        self.num_calls += 1
        if self.answering.is_set():
            self.health.record_success()
            return True
        self.health.record_failure("probe: refused")
        return False


def _health() -> tuple[BackendHealth, SwitchedProbe]:
    probe = SwitchedProbe()
    probe.health = BackendHealth("redis", HealthPolicy(failure_threshold=2, cooldown_s=COOLDOWN_S), probe=probe)
    return probe.health, probe


def _wait(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.01)


def test_an_unhealthy_backend_is_not_tried_until_its_background_probe_answers():
    health, probe = _health()
    health.record_failure("put: timed out")
    assert health.can_try()  # one failure: still healthy
    health.record_failure("put: timed out")
    assert not health.is_healthy and not health.can_try()
    _wait(lambda: probe.num_calls >= 3)  # probed every cool-down meanwhile
    assert not health.can_try() and "probed every" in health.skip_reason()
    probe.answering.set()
    _wait(lambda: health.is_healthy)
    assert health.can_try() and health.last_error == ""
    _wait(lambda: not health.is_probing)  # healthy: the probe thread has ended
    calls = probe.num_calls
    for _ in range(3):
        health.record_success()
    assert probe.num_calls == calls and not health.is_probing  # no more probes


def test_a_second_outage_is_probed_again_and_close_stops_the_probe():
    health, probe = _health()
    probe.answering.set()
    for _ in range(2):
        health.record_failure("put: timed out")
    _wait(lambda: health.is_healthy)
    probe.answering.clear()
    for _ in range(2):
        health.record_failure("get: timed out")
    assert not health.can_try()
    probe.answering.set()
    _wait(lambda: health.is_healthy)
    probe.answering.clear()
    _wait(lambda: not health.is_probing)
    health.close()
    calls = probe.num_calls
    for _ in range(2):
        health.record_failure("get: timed out")
    assert not health.is_probing and not health.is_healthy  # closed: no probe starts
    assert probe.num_calls == calls


def test_without_a_probe_the_next_call_after_the_cool_down_is_the_probe():
    now = [0.0]
    health = BackendHealth("ucx", HealthPolicy(failure_threshold=1, cooldown_s=5.0), clock=lambda: now[0])
    health.record_failure("send: timed out")
    assert not health.can_try()
    now[0] = 5.0
    assert health.can_try() and "probe after 5s" in health.skip_reason()

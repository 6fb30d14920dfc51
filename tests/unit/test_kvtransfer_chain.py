"""The fallback chain and backend health. Transports are small fakes here (the real ones run
in the conformance and fallback suites); the store is a real directory."""
from __future__ import annotations

import time

import pytest

from pdserve.common.errors import TransferError
from pdserve.kvtransfer.backends.disk import DiskStore
from pdserve.kvtransfer.base import KVTransport
from pdserve.kvtransfer.chain import FallbackChain, SendJob
from pdserve.kvtransfer.codec import encode_message, new_transfer_id
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.health import BackendHealth, HealthPolicy
from pdserve.kvtransfer.sink import limits_for
from kvcaches import tiny_layout
from pdserve.kvtransfer.verdict import RECOMPUTE, Landing
from pdserve.kvtransfer.wire import HEADER_SIZE, payload_nbytes
from support import FakeClock

LAYOUT = tiny_layout(num_blocks=16)
LIMITS = limits_for(LAYOUT)
NBYTES = payload_nbytes(2, LAYOUT.num_layers, LAYOUT.block_size, LAYOUT.num_kv_heads,
                        LAYOUT.head_dim, LAYOUT.dtype)


class FakeTransport(KVTransport):
    """Records sends; fails with `error` while it is set."""

    def __init__(self, name: str, error: Exception | None = None) -> None:
        self.name = name
        self.error = error
        self.sent: list[tuple[str, float]] = []

    def open_receiver(self, sink) -> str:
        return "fake"

    def send(self, endpoint, message, deadline) -> None:
        self.sent.append((endpoint, deadline))
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        pass


def job(order=(), endpoints=None, deadline=None, keys=(31, -5)) -> SendJob:
    tid = new_transfer_id()
    message = encode_message(LIMITS, tid, [3, 4], keys, bytes(NBYTES))
    return SendJob(tid, message, tuple(keys),
                   {"ucx": "u:1", "nccl": "n:1"} if endpoints is None else endpoints,
                   tuple(order), time.monotonic() + 30 if deadline is None else deadline)


def test_first_healthy_backend_carries_the_transfer():
    ucx, nccl = FakeTransport("ucx"), FakeTransport("nccl")
    chain = FallbackChain(("ucx", "nccl", RECOMPUTE), transports={"ucx": ucx, "nccl": nccl})
    verdict = chain.send(job())
    assert (verdict.landing, verdict.backend, verdict.fallbacks) == (Landing.LANDED, "ucx", ())
    assert verdict.num_blocks == 2 and verdict.num_bytes == HEADER_SIZE + 32 + NBYTES
    assert nccl.sent == [] and ucx.sent[0][0] == "u:1"
    assert verdict.fetch_keys == ()  # point-to-point: nothing to fetch


def test_failures_fall_through_with_reasons_to_a_store(tmp_path):
    ucx = FakeTransport("ucx", TransferError("refused by receiver: checksum"))
    nccl = FakeTransport("nccl", TimeoutError("no answer"))
    chain = FallbackChain(("ucx", "nccl", "redis", "disk", RECOMPUTE),
                          transports={"ucx": ucx, "nccl": nccl},
                          stores={"disk": DiskStore(tmp_path)},
                          unavailable={"redis": "unavailable here: redis store not configured"})
    verdict = chain.send(job())
    assert verdict.backend == "disk" and verdict.ok and verdict.via_store
    assert verdict.fetch_keys == (31, -5)
    reasons = {f.backend: f.reason for f in verdict.fallbacks}
    assert list(reasons) == ["ucx", "nccl", "redis"]
    assert "checksum" in reasons["ucx"] and "timed out" in reasons["nccl"]
    assert "not configured" in reasons["redis"]
    line = verdict.describe()
    assert "via disk" in line and "ucx: TransferError" in line and "nccl: timed out" in line


def test_missing_endpoint_and_unknown_backend_are_skipped():
    ucx = FakeTransport("ucx")
    chain = FallbackChain(("ucx", "nccl", RECOMPUTE), transports={"ucx": ucx})
    verdict = chain.send(job(endpoints={}))
    assert verdict.landing == Landing.MISSING and verdict.backend == ""  # not carried: the receiver decides
    assert [(f.backend, f.reason) for f in verdict.fallbacks] == [
        ("ucx", "the receiver has no endpoint for it"), ("nccl", "not configured on the sender")]
    assert ucx.sent == []


def test_receiver_order_wins_and_without_recompute_the_transfer_fails():
    ucx = FakeTransport("ucx", TransferError("down"))
    nccl = FakeTransport("nccl")
    chain = FallbackChain(("ucx", "nccl", RECOMPUTE), transports={"ucx": ucx, "nccl": nccl})
    assert chain.send(job(order=("nccl",))).backend == "nccl" and ucx.sent == []
    verdict = chain.send(job(order=("ucx",)))
    assert verdict.landing == Landing.MISSING and verdict.backend == "" and not verdict.ok


def test_step_deadline_is_the_smaller_of_step_timeout_and_transfer_deadline():
    ucx = FakeTransport("ucx")
    chain = FallbackChain(("ucx",), transports={"ucx": ucx}, step_timeout_s=2.0)
    before = time.monotonic()
    chain.send(job())
    assert before + 1.9 < ucx.sent[0][1] <= time.monotonic() + 2.0
    near = time.monotonic() + 0.5
    chain.send(job(deadline=near))
    assert ucx.sent[1][1] == near


def test_a_passed_deadline_skips_every_backend():
    ucx = FakeTransport("ucx")
    chain = FallbackChain(("ucx", RECOMPUTE), transports={"ucx": ucx})
    verdict = chain.send(job(deadline=time.monotonic() - 1))
    assert verdict.landing == Landing.MISSING and ucx.sent == []
    assert verdict.fallbacks[0].reason == "the transfer's deadline passed"


def test_unhealthy_backend_is_skipped_until_a_probe_succeeds():
    ucx = FakeTransport("ucx", TransferError("connection refused"))
    nccl = FakeTransport("nccl")
    clock = FakeClock()
    chain = FallbackChain(("ucx", "nccl"), transports={"ucx": ucx, "nccl": nccl},
                          health_policy=HealthPolicy(failure_threshold=2, cooldown_s=0.2), clock=clock)
    for _ in range(2):
        assert chain.send(job()).backend == "nccl"
    assert len(ucx.sent) == 2 and not chain.health["ucx"].is_healthy
    verdict = chain.send(job())
    assert len(ucx.sent) == 2  # skipped, not tried
    assert "unhealthy after 2 failures" in verdict.fallbacks[0].reason
    clock.now += 0.1
    assert chain.send(job()).backend == "nccl" and len(ucx.sent) == 2  # still cooling down
    clock.now += 0.15
    ucx.error = None
    assert chain.send(job()).backend == "ucx"  # the probe (the next real send) succeeded
    assert chain.health["ucx"].is_healthy


def test_states_and_unusable_say_before_any_work_whether_a_transfer_can_go():
    """What a sender checks before computing a prompt, and what workers report: every backend
    in its cool-down (or unopened, or unreachable) means no backend; a due probe counts as usable."""
    ucx = FakeTransport("ucx", TransferError("connection refused"))
    clock = FakeClock()
    chain = FallbackChain(("ucx", "redis", RECOMPUTE), transports={"ucx": ucx},
                          unavailable={"redis": "unavailable here: redis store not configured"},
                          health_policy=HealthPolicy(failure_threshold=1, cooldown_s=5), clock=clock)
    assert chain.unusable({"ucx": "u:1"}) == []
    assert [(s.name, s.usable) for s in chain.states()] == [("ucx", True), ("redis", False)]
    assert "not configured" in chain.states()[1].detail
    assert [f.backend for f in chain.unusable({})] == ["ucx", "redis"]  # no endpoint for ucx

    chain.send(job())  # ucx fails once: unhealthy for 5 s
    skipped = chain.unusable({"ucx": "u:1"})
    assert [f.backend for f in skipped] == ["ucx", "redis"]
    assert "unhealthy after 1 failures" in skipped[0].reason and "connection refused" in skipped[0].reason
    assert not chain.states()[0].usable and "connection refused" in chain.states()[0].detail
    assert chain.unusable({"ucx": "u:1"}, order=("redis", "ucx"))[0].backend == "redis"  # the receiver's order
    clock.now += 5
    assert chain.unusable({"ucx": "u:1"}) == [] and chain.states()[0].usable  # the probe is due


def test_a_backend_bug_does_not_end_the_chain():
    ucx = FakeTransport("ucx", KeyError("oops"))
    chain = FallbackChain(("ucx", RECOMPUTE), transports={"ucx": ucx})
    verdict = chain.send(job())
    assert verdict.landing == Landing.MISSING and "KeyError" in verdict.fallbacks[0].reason


def test_health_state_machine():
    clock = FakeClock(0.0)
    health = BackendHealth("x", HealthPolicy(failure_threshold=3, cooldown_s=10), clock)
    health.record_failure("a")
    health.record_failure("b")
    assert health.is_healthy and health.can_try()
    health.record_success()  # resets the run
    for reason in "cde":
        health.record_failure(reason)
    assert not health.is_healthy and not health.can_try() and "last: e" in health.skip_reason()
    clock.now = 10
    assert health.can_try()  # probe due
    health.record_failure("probe failed")  # one failure while down restarts the cool-down
    assert not health.can_try()
    clock.now = 20
    health.record_success()
    assert health.is_healthy and health.num_consecutive_failures == 0


def test_config_validates_the_chain():
    assert KVTransferConfig.from_settings("ucx, disk").backends == ("ucx", "disk", RECOMPUTE)
    with pytest.raises(ValueError, match="unknown"):
        KVTransferConfig(backends=("ucx", "carrier-pigeon"))
    with pytest.raises(ValueError, match="end the chain"):
        KVTransferConfig(backends=(RECOMPUTE, "ucx"))
    with pytest.raises(ValueError):
        KVTransferConfig(prefix_cache="ucx")

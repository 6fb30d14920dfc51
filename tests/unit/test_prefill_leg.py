"""Decode's prefill leg against a real grpc.aio Prefill server on 127.0.0.1 whose servicer is
slow on purpose: the leg's deadline (`--prefill-timeout-s`) bounds the whole remote prefill,
a reply inside it settles through the receiver, and a miss cancels the reservation."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc
import pytest

from pdserve.decode.prefill_leg import PrefillLeg
from pdserve.kvtransfer.verdict import Landing
from pdserve.proto.pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc


SKIPPED = "no_usable_kv_backend: disk: unhealthy after 3 failures in a row"


class SlowPrefill(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, delay_s: float, skip: bool = False) -> None:
        self.delay_s = delay_s
        self.skip = skip
        self.requests: list[prefill_pb2.PrefillRequest] = []

    async def Prefill(self, request, context):
        self.requests.append(request)
        await asyncio.sleep(self.delay_s)
        if self.skip:  # what a prefill with no usable backend answers, having computed nothing
            return prefill_pb2.PrefillResponse(skipped=True, verdict=common_pb2.TransferVerdict(
                outcome=common_pb2.TRANSFER_OUTCOME_FAILED, reason=SKIPPED,
                fallbacks=[common_pb2.FallbackStep(backend="disk", reason="unhealthy after 3 failures in a row")]))
        return prefill_pb2.PrefillResponse(
            first_token_id=7,
            verdict=common_pb2.TransferVerdict(outcome=common_pb2.TRANSFER_OUTCOME_TRANSFERRED, backend="disk"))


@dataclass
class RecordingReceives:
    """Isolates the leg from the transfer layer (a `ReceiveControl`): records what the leg
    asks of it; each reservation's time to live, in seconds."""

    prepared: list[tuple[str, float]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    @property
    def endpoints(self):
        return {"disk": "/tmp/kv"}

    def prepare_receive(self, request_id, block_ids, num_prompt_tokens, num_leading_blocks, deadline,
                        transfer_id=None, block_hashes=None):
        self.prepared.append((request_id, round(deadline - time.time(), 1)))
        return None

    def complete_receive(self, request_id, verdict):
        return verdict

    def cancel_receive(self, request_id):
        self.cancelled.append(request_id)
        return True


@dataclass(frozen=True)
class Choice:
    worker_id: str
    address: str


async def run_leg(delay_s: float, timeout_s: float, monkeypatch, skip: bool = False):
    # the hand-off message itself is the transfer layer's business, not this test's
    monkeypatch.setattr("pdserve.worker.transfer.params_to_handoff", lambda *a: prefill_pb2.KVHandoff())
    server = grpc.aio.server()
    servicer = SlowPrefill(delay_s, skip)
    prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    receiver = RecordingReceives()
    leg = PrefillLeg(receiver, worker_id="decode-0", compat_hash=1, block_size=16, timeout_s=timeout_s)
    try:
        start = time.monotonic()
        result = await leg.run("req-1", [1, 2, 3], [], common_pb2.SamplingParams(),
                               Choice("prefill-0", f"127.0.0.1:{port}"), [1], 0)
        assert [r.request_id for r in servicer.requests] == ["req-1"]
        return result, time.monotonic() - start, receiver
    finally:
        await leg.close()
        await server.stop(0)


async def test_a_prefill_slower_than_the_deadline_fails_the_leg_at_the_deadline(monkeypatch):
    result, elapsed, receiver = await run_leg(delay_s=30.0, timeout_s=0.5, monkeypatch=monkeypatch)
    assert not result.ok and result.verdict.landing == Landing.MISSING  # did not land; not aborted
    assert result.verdict.peer_status == "DEADLINE_EXCEEDED"
    assert result.verdict.landing == Landing.MISSING
    assert 0.4 < elapsed < 5.0
    assert receiver.prepared == [("req-1", 0.5)]  # the reservation lives as long as the leg
    assert receiver.cancelled == ["req-1"]


async def test_a_slow_prefill_inside_the_deadline_completes(monkeypatch):
    result, elapsed, receiver = await run_leg(delay_s=1.0, timeout_s=10.0, monkeypatch=monkeypatch)
    assert result.ok, result.verdict
    assert result.first_token_id == 7 and result.verdict.peer == "prefill-0"
    assert elapsed >= 1.0 and receiver.cancelled == []


async def test_a_prefill_that_skipped_the_prompt_fails_the_leg_with_its_reason(monkeypatch):
    """No KV backend could carry the blocks, so the prefill computed nothing: the reservation
    is dropped (nothing will arrive) and decode's verdict carries why, for its recompute."""
    result, _, receiver = await run_leg(delay_s=0.0, timeout_s=5.0, monkeypatch=monkeypatch, skip=True)
    assert not result.ok and result.verdict.landing == Landing.MISSING  # did not land; not aborted
    assert result.verdict.reason == SKIPPED and result.verdict.peer == "prefill-0"
    assert [f.backend for f in result.verdict.fallbacks] == ["disk"]
    assert receiver.cancelled == ["req-1"]


def test_prefill_timeout_is_a_decode_setting(monkeypatch):
    from pdserve.deploy import cli
    from pdserve.worker.settings import WorkerSettings

    parser = cli.build_parser()
    args = parser.parse_args(["decode", "--prefill-timeout-s", "90"])
    settings = WorkerSettings.from_settings("decode", cli.resolve(args, environ={}))
    assert settings.prefill_timeout_s == 90.0
    assert WorkerSettings(role="decode").prefill_timeout_s == 60.0
    with pytest.raises(SystemExit):
        parser.parse_args(["decode", "--prefill-timeout-s", "soon"])

"""Who may end a prefill's request, against the real Prefill servicer on 127.0.0.1 behind the
cluster secret's interceptor: only the decode its hand-off names may abort it (another
caller's Abort finds nothing, and is logged), and a second Prefill under an id in flight is
refused without touching the first. And the hand-off ledger forgets expired hand-offs by
deadline, whatever order they came in."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
import pytest

from pdserve.common.block_hash import prompt_blocks
from pdserve.common.errors import OverloadedError
from pdserve.kvtransfer.codec import new_transfer_id
from pdserve.prefill.runner import PrefillRunner
from pdserve.prefill.servicer import PrefillService
from pdserve.proto.pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from pdserve.rpc.credentials import InternalAuth, internal_channel
from pdserve.rpc.server import WORKER_MAX_RECEIVE_BYTES, internal_server
from pdserve.security.handoffs import HandoffLedger, ReplayedHandoffError
from pdserve.security.secret import ClusterSecret
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.transfer import sign_handoff
from support import FakeClock, KeyBook


class Engine:
    compat_hash = 7

    def prompt_blocks(self, token_ids, cache_salt=""):  # LLMEngine.prompt_blocks, 16-token blocks
        return prompt_blocks(token_ids, 16, self.compat_hash, cache_salt=cache_salt)


class HoldingLoop:
    """An engine loop that takes prompts and never finishes them; records adds and aborts."""

    engine = Engine()

    def __init__(self) -> None:
        self.added: list[str] = []
        self.aborted: list[str] = []

    async def add_request(self, prompt, params, *, request_id, **kwargs):
        self.added.append(request_id)
        return NeverDone()

    async def abort(self, request_id):
        self.aborted.append(request_id)
        return True


class NeverDone:
    async def next(self, timeout):
        await asyncio.Event().wait()


class RecordingSends:
    """The transfer layer's send side (a `SendControl`), every backend usable; records
    aborted sends."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def unusable(self, params):
        return []

    def connect_ahead(self, params):
        pass

    def wait_verdict(self, request_id, timeout_s):
        return None

    def abort_send(self, request_id):
        self.aborted.append(request_id)
        return True


@contextlib.asynccontextmanager
async def prefill_server():
    """(runner, stub per caller id) of a Prefill service whose hand-offs are signed."""
    auth = InternalAuth(ClusterSecret(b"s" * 32))
    book = KeyBook(auth.secret)
    runner = PrefillRunner(HoldingLoop(), RecordingSends(), WorkerMetrics("prefill"), block_size=16, max_queue=4,
                           handoff_mac=auth.handoff_mac())
    server = internal_server(WORKER_MAX_RECEIVE_BYTES, auth.interceptors(
        [prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name], lambda reason: None, book))
    prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillService(runner, "tiny"), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    channels: dict[str, grpc.aio.Channel] = {}

    def stub(caller: str) -> prefill_pb2_grpc.PrefillStub:
        if caller not in channels:
            channels[caller] = internal_channel(address, book.signer(caller))
        return prefill_pb2_grpc.PrefillStub(channels[caller])

    try:
        yield runner, stub
    finally:
        for channel in channels.values():
            await channel.close()
        await server.stop(0)


def signed_request(rid: str, decode: str) -> prefill_pb2.PrefillRequest:
    request = prefill_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=list(range(20)), sampling=common_pb2.SamplingParams(max_tokens=4),
        handoff=prefill_pb2.KVHandoff(transfer_id=new_transfer_id().hex(), compatibility_hash=7, block_ids=[1, 2],
                                      backends=["disk", "recompute"], decode_worker_id=decode,
                                      deadline_unix_ms=int(time.time() * 1000) + 30_000))
    sign_handoff(request, InternalAuth(ClusterSecret(b"s" * 32)).handoff_mac())
    return request


async def started(runner: PrefillRunner, stub, rid: str, decode: str):
    call = stub(decode).Prefill(signed_request(rid, decode), timeout=30)
    deadline = time.monotonic() + 10
    while rid not in runner.loop.added:
        assert time.monotonic() < deadline, "the prefill did not start"
        await asyncio.sleep(0.01)
    return call


async def test_only_the_decode_its_handoff_names_may_abort_a_prefill(caplog):
    async with prefill_server() as (runner, stub):
        call = await started(runner, stub, "r1", "decode-0")
        with caplog.at_level(logging.WARNING, logger="pdserve.prefill"):
            other = await stub("decode-1").Abort(common_pb2.AbortRequest(request_id="r1"), timeout=10)
        assert not other.found
        assert runner.loop.aborted == [] and runner.sends.aborted == []
        assert "abort of request 'r1' by 'decode-1' refused" in caplog.text

        unknown = await stub("decode-0").Abort(common_pb2.AbortRequest(request_id="r2"), timeout=10)
        assert not unknown.found and runner.loop.aborted == []

        owner = await stub("decode-0").Abort(common_pb2.AbortRequest(request_id="r1"), timeout=10)
        assert owner.found
        assert runner.loop.aborted == ["r1"] and runner.sends.aborted == ["r1"]
        call.cancel()


async def test_a_duplicate_request_id_is_refused_and_the_first_runs_on():
    async with prefill_server() as (runner, stub):
        call = await started(runner, stub, "r1", "decode-0")
        for decode in ("decode-0", "decode-1"):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub(decode).Prefill(signed_request("r1", decode), timeout=10)
            assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert runner.loop.added == ["r1"] and runner.loop.aborted == [] and runner.sends.aborted == []
        assert runner.num_inflight == 1 and len(runner.ledger) == 1  # the refused hand-offs are not spent
        assert not call.done()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call


def test_the_ledger_forgets_expired_handoffs_by_deadline_whatever_order_they_came_in():
    """One hand-off with a long deadline first, then expired ones behind it: they go, and new
    hand-offs are taken; the bound still refuses rather than forgets a live one."""
    clock = FakeClock(1000.0)
    ledger = HandoffLedger(max_remembered=1000, clock=clock)
    ledger.accept("long", 1000.0 + 3000)
    for i in range(999):
        ledger.accept(f"t{i}", 1010.0 + i % 7)
    with pytest.raises(OverloadedError):
        ledger.accept("late", 1020.0)  # 1000 live
    clock.now = 1017.0  # every t* expired; "long" lives
    ledger.accept("new", 1030.0)
    assert len(ledger) == 2
    with pytest.raises(ReplayedHandoffError):
        ledger.accept("long", 1000.0 + 3000)
    with pytest.raises(ReplayedHandoffError):
        ledger.accept("new", 1030.0)
    for i in range(998):
        ledger.accept(f"u{i}", 1040.0)
    with pytest.raises(OverloadedError):
        ledger.accept("one-too-many", 1040.0)

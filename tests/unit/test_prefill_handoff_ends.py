"""A prefill whose decode stops answering mid hand-off (frozen or killed): its send waits for
the peer up to the hand-off's deadline, and the request's blocks stay with the send that
reads them until it ends. Meanwhile the request's id is taken — a second prefill under it
(the router retrying on another decode) is refused and the first is left alone — and once
the send ends every block is back in the pool. Real engines (tiny model, CPU); the peer is a
transport that never answers until the test lets it hang up."""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer import KVTransferConfig, connector_factory
from pdserve.kvtransfer.base import KVTransport
from pdserve.kvtransfer.codec import new_transfer_id
from pdserve.kvtransfer.health import BackendHealth, HealthPolicy
from pdserve.kvtransfer.params import TransferParams
from pdserve.kvtransfer.verdict import RECOMPUTE, Landing
from pdserve.prefill.runner import PrefillRunner
from pdserve.prefill.servicer import PrefillService
from pdserve.proto.pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from pdserve.rpc.credentials import InternalAuth, internal_channel
from pdserve.rpc.server import WORKER_MAX_RECEIVE_BYTES, internal_server
from pdserve.security.secret import ClusterSecret
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.transfer import sign_handoff
from support import KeyBook

BLOCK = 16
PROMPT = list(range(3, 40))  # 3 blocks
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


class SilentPeer(KVTransport):
    """A receiver that takes the connection and never answers: each send waits until the
    deadline, or until `hang_up` (then it fails as a dead peer's does); after `answer`, sends
    land at once."""

    name = "peer"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._done = threading.Event()
        self._ok = False

    def send(self, endpoint, message, deadline) -> None:
        self.entered.set()
        if not self._done.wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError("the peer gave no answer before the deadline")
        if not self._ok:
            raise ConnectionResetError("the peer hung up")

    def hang_up(self) -> None:
        self._done.set()

    def answer(self) -> None:
        self._ok = True
        self._done.set()

    def open_receiver(self, sink) -> str:
        raise NotImplementedError

    def close(self) -> None:
        self._done.set()


def prefill_llm(model_dir, **overrides) -> tuple[LLM, SilentPeer]:
    llm = LLM(str(model_dir), connector=connector_factory(KVTransferConfig(backends=(RECOMPUTE,)), listen=False),
              num_blocks=64, block_size=BLOCK, **overrides)
    peer = SilentPeer()
    chain = llm.engine.connector.sends.chain
    chain.transports["peer"] = peer
    chain.health["peer"] = BackendHealth("peer", HealthPolicy(), time.monotonic)
    return llm, peer


def run_until(llm, done, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the engine did not get there in time"
        llm.step()


def test_an_id_whose_blocks_a_send_still_reads_is_refused_and_the_blocks_come_back(tiny_model_factory):
    """Step by step: the first request's prompt is computed and its send waits on the silent
    peer; a second request under its id is refused (the engine goes on stepping, other
    requests run), and when the peer hangs up every block is back."""
    llm, peer = prefill_llm(tiny_model_factory("llama"))
    engine = llm.engine
    try:
        params = TransferParams(new_transfer_id(), (1, 2, 3), 0, time.time() + 30, engine.compat_hash,
                                (("peer", "10.0.0.2:1"),), ("peer", RECOMPUTE))
        engine.add_request(PROMPT, FIRST_TOKEN, request_id="x", transfer_params=params)
        run_until(llm, lambda: peer.entered.is_set() and engine.stats().num_running == 0)
        assert engine.kv.get_num_free_blocks() < engine.kv.get_max_resource_count()  # the send's

        with pytest.raises(InvalidRequestError, match="already in use"):
            engine.add_request(PROMPT, FIRST_TOKEN, request_id="x", transfer_params=params)
        engine.add_request(PROMPT, FIRST_TOKEN, request_id="y")  # the engine serves on
        run_until(llm, lambda: engine.stats().num_running == 0 and engine.stats().num_waiting == 0)
        assert engine.has_unfinished()  # x's send still holds its blocks

        peer.hang_up()
        run_until(llm, lambda: not engine.has_unfinished())
        assert engine.connector.sends.wait_verdict("x", 10).landing == Landing.MISSING
        engine.assert_no_leaks()
    finally:
        peer.hang_up()  # the stream still sending gives up now, not at its deadline
        engine.connector.worker.close()


def test_an_abort_that_meets_the_engines_end_of_the_request_frees_its_blocks(tiny_model_factory):
    """The service drops a send not started while the engine, on its own thread, ends the
    request: whichever comes second finds the other's mark, and the blocks come back. The
    engine's end is run inside the abort's window (as its thread may) to make it certain."""
    llm, peer = prefill_llm(tiny_model_factory("llama"), max_num_tokens=16)  # the prompt takes 3 steps
    engine = llm.engine
    sends = engine.connector.sends
    try:
        params = TransferParams(new_transfer_id(), (1, 2, 3), 0, time.time() + 30, engine.compat_hash,
                                (("peer", "10.0.0.2:1"),), ("peer", RECOMPUTE))
        engine.add_request(PROMPT, FIRST_TOKEN, request_id="x", transfer_params=params)
        llm.step()  # announced, the prompt not computed
        post = sends.book.verdicts.post

        def engine_ends_it_first(request_id, verdict):
            assert engine.abort(request_id)
            llm.step()  # the engine tells the connector the request ended
            post(request_id, verdict)

        sends.book.verdicts.post = engine_ends_it_first
        assert sends.abort_send("x")
        run_until(llm, lambda: not engine.has_unfinished(), timeout_s=10)
        engine.assert_no_leaks()
    finally:
        peer.hang_up()  # the stream still sending gives up now, not at its deadline
        engine.connector.worker.close()


class PrefillServer:
    """The real Prefill servicer on 127.0.0.1, on a worker's internal server behind the
    cluster secret's interceptor, over a real engine on its own thread."""

    def __init__(self, llm: LLM, secret: ClusterSecret) -> None:
        self.auth = InternalAuth(secret)
        self.book = KeyBook(secret)
        self.loop = EngineLoop(llm.engine)
        self.runner = PrefillRunner(self.loop, llm.engine.connector.sends, WorkerMetrics("prefill"),
                                    block_size=BLOCK, max_queue=4, handoff_mac=self.auth.handoff_mac())
        self.server = internal_server(WORKER_MAX_RECEIVE_BYTES, self.auth.interceptors(
            [prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name], lambda reason: None, self.book))
        prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillService(self.runner, "tiny"), self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self._channels: list[grpc.aio.Channel] = []

    async def __aenter__(self) -> "PrefillServer":
        self.loop.start(asyncio.get_running_loop())
        await self.server.start()
        return self

    async def __aexit__(self, *exc) -> None:
        for channel in self._channels:
            await channel.close()
        await self.server.stop(0)
        self.loop.stop()

    def stub(self, caller: str) -> prefill_pb2_grpc.PrefillStub:
        self._channels.append(internal_channel(self.address, self.book.signer(caller)))
        return prefill_pb2_grpc.PrefillStub(self._channels[-1])

    def request(self, rid: str, decode: str) -> prefill_pb2.PrefillRequest:
        engine = self.loop.engine
        request = prefill_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=4),
            handoff=prefill_pb2.KVHandoff(
                transfer_id=new_transfer_id().hex(), backends=["peer", RECOMPUTE],
                endpoints=[prefill_pb2.TransferEndpoint(backend="peer", address="10.0.0.2:1")],
                block_ids=[1, 2, 3], deadline_unix_ms=int((time.time() + 30) * 1000),
                compatibility_hash=engine.compat_hash, decode_worker_id=decode))
        sign_handoff(request, self.auth.handoff_mac())
        return request

    async def num_free_blocks(self) -> int:
        return await self.loop.call(self.loop.engine.kv.get_num_free_blocks)


async def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "not reached in time"
        await asyncio.sleep(0.02)


async def test_a_prefill_cancelled_while_its_send_waits_on_a_silent_decode_frees_every_block(tiny_model_factory):
    """Over gRPC: decode-0's Prefill is cancelled while the verdict is awaited (its send waits
    on the silent peer). Until the send ends, a Prefill under the same id is refused
    (INVALID_ARGUMENT) and the engine lives on; once the peer hangs up every block is back,
    and the id prefills again."""
    llm, peer = prefill_llm(tiny_model_factory("llama"))
    total = llm.engine.kv.get_max_resource_count()
    try:
        async with PrefillServer(llm, ClusterSecret(b"s" * 32)) as prefill:
            stub = prefill.stub("decode-0")
            first = stub.Prefill(prefill.request("x", "decode-0"), timeout=30)
            await asyncio.to_thread(peer.entered.wait, 20)

            async def computed():  # the prompt's forward is over: what is left is its send
                stats = await prefill.loop.call(llm.engine.stats)
                return stats.num_running == stats.num_waiting == 0
            await wait_for(computed)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first

            async def runner_idle():
                return prefill.runner.num_inflight == 0
            await wait_for(runner_idle)
            assert await prefill.num_free_blocks() < total  # the send under way still reads them
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await prefill.stub("decode-1").Prefill(prefill.request("x", "decode-1"), timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "already in use" in refused.value.details()
            assert prefill.loop.alive

            peer.hang_up()

            async def all_free():
                return await prefill.num_free_blocks() == total
            await wait_for(all_free)
            await prefill.loop.call(llm.engine.assert_no_leaks)

            peer.answer()
            again = await stub.Prefill(prefill.request("x", "decode-0"), timeout=30)
            assert again.verdict.outcome == common_pb2.TRANSFER_OUTCOME_TRANSFERRED
            await wait_for(all_free)
            await prefill.loop.call(llm.engine.assert_no_leaks)
    finally:
        peer.hang_up()
        llm.engine.connector.worker.close()

"""A peer cut off by a partition, played on one host by a frozen process (SIGSTOP): its kernel
still holds its sockets, so no reset comes, only silence, as on a cut link. Decode's remote
prefill must end within seconds by the failure policy, not at its deadline; after the thaw
the next prefill and the next transfer go through on the same path, with no fallback.

The prefill side is this file run as a script in a fresh interpreter (`python
test_partition_heal.py prefill`): a real grpc.aio server with pdserve's server options whose
Prefill answers at once, except for a request id starting with "hang" (it never answers).
"""
from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
from test_transport_p2p import BACKENDS, DEADLINE_S, SLACK_S, make_message, payload_digests

from pdserve.lab.child import Child
from pdserve.common.errors import TransferError, UpstreamFailedError
from pdserve.decode.prefill_leg import PrefillLeg, RemotePrefill
from pdserve.kvtransfer.backends import _p2p
from pdserve.kvtransfer.verdict import Outcome
from pdserve.proto.pdserve.v1 import common_pb2, decode_pb2, prefill_pb2, prefill_pb2_grpc

CUT_TO_ANSWER_S = 15.0  # issue 37: a cut prefill is answered for within this
TCP_ONLY = "tcp,self"  # UCX as between hosts: no shared memory


# -- the prefill process ---------------------------------------------------------------------------
def prefill_main() -> None:
    from pdserve.rpc.server import WORKER_MAX_RECEIVE_BYTES, internal_server

    class Prefill(prefill_pb2_grpc.PrefillServicer):
        async def Prefill(self, request, context):
            print(f"called {request.request_id}", flush=True)
            if request.request_id.startswith("hang"):
                await asyncio.sleep(3600)
            return prefill_pb2.PrefillResponse(first_token_id=7, verdict=common_pb2.TransferVerdict(
                outcome=common_pb2.TRANSFER_OUTCOME_TRANSFERRED, backend="ucx"))

    async def serve() -> None:
        server = internal_server(WORKER_MAX_RECEIVE_BYTES)
        prefill_pb2_grpc.add_PrefillServicer_to_server(Prefill(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(f"port {port}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until EOF
        await server.stop(0)

    asyncio.run(serve())


class PrefillProcess:
    """The prefill process: its stdout lines arrive on `lines`."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "prefill"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.port = int(self.wait_for("port ", 60).split()[1])

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def wait_for(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the prefill process never said {prefix!r}") from None
            if line.startswith(prefix):
                return line

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


class RecordingReceives:
    """Isolates the leg from the transfer layer (a `ReceiveControl`): records what the leg
    asks of it."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    @property
    def endpoints(self):
        return {"ucx": "127.0.0.1:1"}

    def prepare_receive(self, request_id, block_ids, num_prompt_tokens, num_leading_blocks, deadline,
                        transfer_id=None, block_hashes=None):
        return None

    def complete_receive(self, request_id, verdict):
        return verdict

    def cancel_receive(self, request_id):
        self.cancelled.append(request_id)
        return True


@pytest.fixture
def prefill_process():
    process = PrefillProcess()
    yield process
    process.stop()


class RecordingEngine:
    """The engine side of RemotePrefill: records which way each prompt went."""

    def __init__(self) -> None:
        self.finished: list[str] = []
        self.recomputed: list[str] = []

    def finish_remote_prefill(self, rid, first_token_id, first_logprob, prompt_logprobs) -> None:
        self.finished.append(rid)

    def recompute_remote_prefill(self, rid) -> None:
        self.recomputed.append(rid)


class InlineLoop:
    def __init__(self) -> None:
        self.engine = RecordingEngine()

    async def call(self, fn):
        return fn()


class AdmittedStream:
    """A request the engine admitted at once into block 1."""

    block_hashes: list[int] = []

    def __init__(self) -> None:
        self.remote_ready = asyncio.get_running_loop().create_future()
        self.remote_ready.set_result(([1], 0))


async def test_a_frozen_prefill_ends_the_leg_within_seconds_by_the_policy_and_serves_after_the_thaw(
        prefill_process, monkeypatch):
    monkeypatch.setattr("pdserve.worker.transfer.params_to_handoff", lambda *a: prefill_pb2.KVHandoff())
    receiver = RecordingReceives()
    leg = PrefillLeg(receiver, worker_id="decode-0", compat_hash=1, block_size=16, timeout_s=60.0)
    loop = InlineLoop()
    choice = decode_pb2.PrefillChoice(worker_id="prefill-0", address=f"127.0.0.1:{prefill_process.port}")

    def run(rid: str, policy: str = "recompute"):
        remote = RemotePrefill(leg, loop, failure_policy=policy, timeout_s=60.0)
        request = decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=[1, 2, 3], prefill=choice)
        return remote.run(rid, request, AdmittedStream(), common_pb2.RequestTimings(), time.monotonic())

    try:
        assert (await run("warm-0"))[0].outcome == Outcome.TRANSFERRED  # the channel is up
        leg_task = asyncio.ensure_future(run("hang-1"))
        await asyncio.get_running_loop().run_in_executor(None, prefill_process.wait_for, "called hang-1", 30)
        prefill_process.signal(signal.SIGSTOP)
        cut = time.monotonic()
        decided, result = await asyncio.wait_for(leg_task, CUT_TO_ANSWER_S + 5)
        cut_to_answer = time.monotonic() - cut
        print(f"cut to answer: {cut_to_answer:.2f} s")
        assert cut_to_answer < CUT_TO_ANSWER_S
        assert decided.outcome == Outcome.RECOMPUTED and result.verdict.peer_status == "UNAVAILABLE"
        assert "prefill_unavailable: UNAVAILABLE" in decided.reason, decided.reason
        assert loop.engine.recomputed == ["hang-1"]
        assert receiver.cancelled == ["hang-1"]  # no late write lands in the reserved blocks

        start = time.monotonic()  # a prompt sent while the prefill is still cut off
        with pytest.raises(UpstreamFailedError, match="prefill_unavailable: UNAVAILABLE"):
            await run("during-2", policy="fail")
        assert time.monotonic() - start < CUT_TO_ANSWER_S

        prefill_process.signal(signal.SIGCONT)
        start = time.monotonic()
        healed, leg_result = await run("after-3")  # the same channel, reconnected: no fallback
        print(f"first prefill after the thaw: {time.monotonic() - start:.2f} s")
        assert healed.outcome == Outcome.TRANSFERRED, leg_result.verdict
        assert loop.engine.finished == ["warm-0", "after-3"] and loop.engine.recomputed == ["hang-1"]
    finally:
        await leg.close()


# -- the transfer connection ------------------------------------------------------------------------
def receiver_main(backend: str) -> None:
    """A receiving process: the transport under test over test_transport_p2p's TensorSink."""
    from test_transport_p2p import TensorSink, make_transport

    from pdserve.lab.child import serve_commands

    sink = TensorSink()
    transport = make_transport(backend)

    def handle(cmd: dict) -> dict:
        if cmd["cmd"] == "open":
            transport.port = cmd["port"]
            return {"endpoint": transport.open_receiver(sink)}
        if cmd["cmd"] == "digests":
            return {"digests": sink.digests(cmd["blocks"])}
        raise ValueError(f"unknown command {cmd['cmd']!r}")

    serve_commands(handle)


class Receiver(Child):
    """The receiving process, UCX over TCP only (no shared memory: hosts apart)."""

    def __init__(self, backend: str, log_path, port: int = 0) -> None:
        super().__init__([sys.executable, __file__, "receiver", backend], log_path,
                         env={"PDSERVE_UCX_TLS": TCP_ONLY})
        reply = self.call("open", timeout_s=120, port=port)
        assert reply["ok"], reply
        self.endpoint = reply["endpoint"]

    def digests(self, blocks) -> list[str]:
        return self.call("digests", blocks=list(blocks))["digests"]


def make_sender(backend: str):
    if backend == "ucx":
        pytest.importorskip("ucxx", reason="ucxx-cu12 is not installed")
        from pdserve.kvtransfer.backends.ucx import UcxSettings, UcxTransport

        return UcxTransport(settings=UcxSettings(tls=TCP_ONLY))
    if backend == "tcp":
        from pdserve.kvtransfer.backends.tcp import TcpTransport

        return TcpTransport()
    from pdserve.kvtransfer.backends.nccl import NcclTransport

    return NcclTransport(backend="gloo")


@pytest.fixture(params=BACKENDS)
def transfer(request, tmp_path, monkeypatch):
    """(sender, receiver process) of one backend; every reuse of a link is probed first."""
    monkeypatch.setattr(_p2p, "PROBE_IDLE_S", 0.0)
    sender = make_sender(request.param)
    receiver = Receiver(request.param, tmp_path / "receiver.log")
    yield sender, receiver
    sender.close()
    receiver.proc.send_signal(signal.SIGCONT)
    receiver.stop()


def send(sender, receiver: Receiver, blocks: list[int], seed: int, deadline_s: float = DEADLINE_S) -> float:
    """Send blocks and check they arrived bit-identical; the seconds the send took."""
    message = make_message(blocks, seed=seed)
    start = time.monotonic()
    sender.send(receiver.endpoint, message, start + deadline_s)
    took = time.monotonic() - start
    assert receiver.digests(blocks) == payload_digests(message)
    return took


def test_a_frozen_receiver_fails_a_send_by_its_deadline_and_takes_the_next_after_the_thaw(transfer):
    sender, receiver = transfer
    send(sender, receiver, [1, 2], seed=1)
    receiver.proc.send_signal(signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises((TimeoutError, TransferError)):
        sender.send(receiver.endpoint, make_message([3], seed=2), start + 2.0)
    assert time.monotonic() - start < 2.0 + SLACK_S
    receiver.proc.send_signal(signal.SIGCONT)
    took = send(sender, receiver, [4, 5], seed=3)  # the same backend, no fallback
    print(f"first send after the thaw: {took * 1000:.0f} ms")


def test_a_link_from_before_the_receiver_restarted_is_replaced_before_use(transfer, tmp_path):
    sender, receiver = transfer
    send(sender, receiver, [1, 2], seed=4)  # the sender now holds a link to this process
    port = int(receiver.endpoint.rpartition(":")[2])
    receiver.proc.kill()
    receiver.proc.wait(timeout=10)
    restarted = Receiver(transfer_backend(sender), tmp_path / "restarted.log", port=port)
    try:
        assert restarted.endpoint == receiver.endpoint
        took = send(sender, restarted, [6, 7], seed=5)  # the first send goes through
        print(f"first send to the restarted receiver: {took * 1000:.0f} ms")
    finally:
        restarted.stop()


def test_a_ucx_link_whose_endpoint_died_under_a_live_control_connection_is_replaced(transfer):
    """What a partition leaves behind: UCX's own connection timed out, the control connection
    (idle, never written during the cut) survived. The probe finds it before a request goes."""
    sender, receiver = transfer
    if transfer_backend(sender) != "ucx":
        pytest.skip("a ucx link's endpoint")
    send(sender, receiver, [1, 2], seed=6)
    link = sender._pool._links[receiver.endpoint]

    async def kill_endpoint() -> None:
        link.channel.ep.abort()

    link.channel.runtime.run(kill_endpoint(), 5.0)
    took = send(sender, receiver, [8, 9], seed=7)
    assert sender._pool._links[receiver.endpoint] is not link  # replaced, not reused
    print(f"first send after the endpoint died: {took * 1000:.0f} ms")


def transfer_backend(sender) -> str:
    return sender.name


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if sys.argv[1:] == ["prefill"]:
        prefill_main()
    elif sys.argv[1] == "receiver":
        receiver_main(sys.argv[2])

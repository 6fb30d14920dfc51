"""The point-to-point transports (ucx over TCP/shared memory, nccl over gloo, and tcp: the link
protocol over a plain socket channel) between two OS
processes, each against a tiny in-test sink: the unit under test is the transport.

This process sends. The receiver is this same file run as a script in a fresh interpreter
(`python test_transport_p2p.py BACKEND`): it opens the transport over `TensorSink`, a plain
uint8 tensor of blocks, and obeys JSON-line commands on stdin. Nothing crosses the process
boundary pickled: commands and replies are JSON, blocks travel through the transport.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time

import pytest
import torch
import xxhash

from pdserve.lab.child import Child, serve_commands
from pdserve.common.errors import TransferError
from pdserve.kvtransfer.backends import _p2p, _payload
from pdserve.kvtransfer.backends.ucx import _UcxChannel
from pdserve.kvtransfer.base import BlockMessage
from pdserve.security import transfer_session
from pdserve.kvtransfer.wire import (
    HEADER_SIZE, WireLimits, encode_header, encode_index, parse_index, payload_nbytes, verify_payload,
)

BACKENDS = ("ucx", "nccl", "tcp")
NUM_BLOCKS = 32
LAYOUT = dict(dtype="float32", num_layers=2, block_size=16, num_kv_heads=2, head_dim=64)
COMPAT = 0x5EED_C0DE
BLOCK_NBYTES = payload_nbytes(1, LAYOUT["num_layers"], LAYOUT["block_size"],
                              LAYOUT["num_kv_heads"], LAYOUT["head_dim"], LAYOUT["dtype"])  # 16 KiB
DEADLINE_S = 10.0
SLACK_S = 4.0  # how far past its deadline a call may return on a loaded 2-core box
NUM_IDLE = 300  # idle connections per port (the full 1,000 was measured by hand: README)
CHUNK_BYTES = transfer_session.PAYLOAD_CHUNK_BYTES
UCX_CHUNK_BYTES = _UcxChannel.sealed_chunk_bytes


def limits() -> WireLimits:
    return WireLimits(compat_hash=COMPAT, max_blocks=NUM_BLOCKS, **LAYOUT)


def make_transport(name: str):
    if name == "ucx":
        from pdserve.kvtransfer.backends.ucx import UcxTransport

        return UcxTransport()
    if name == "tcp":  # the link protocol with payloads on its control connection
        from pdserve.kvtransfer.backends.tcp import TcpTransport

        return TcpTransport()
    from pdserve.kvtransfer.backends.nccl import NcclTransport

    return NcclTransport(backend="gloo")


class TensorSink:
    """A `BlockSink` over one uint8 tensor `[NUM_BLOCKS, BLOCK_NBYTES]`. It checks only what a
    transport relies on (layout via `limits`, index bounds, checksum, duplicates); `stall_s`
    makes `check` hang, to play a receiver that never answers."""

    def __init__(self) -> None:
        self.cache = torch.zeros(NUM_BLOCKS, BLOCK_NBYTES, dtype=torch.uint8)
        self.done: set[bytes] = set()
        self.stall_s = 0.0
        self.num_stalled = 0  # checks sleeping through a stall now

    @property
    def limits(self) -> WireLimits:
        return limits()

    def check(self, header, index) -> None:
        self.num_stalled += 1
        try:
            time.sleep(self.stall_s)  # plays a receiver that does not answer
        finally:
            self.num_stalled -= 1
        parse_index(header, index, NUM_BLOCKS)
        if header.transfer_id in self.done:
            raise TransferError(f"duplicate transfer id {header.transfer_id.hex()}")

    def staging(self, header) -> torch.Tensor:
        return torch.empty(header.payload_len, dtype=torch.uint8)

    def commit(self, header, index, payload) -> None:
        verify_payload(header, index, memoryview(payload.numpy()))
        block_ids, _ = parse_index(header, index, NUM_BLOCKS)
        self.cache[block_ids] = payload.view(len(block_ids), BLOCK_NBYTES)
        self.done.add(header.transfer_id)

    def digests(self, block_ids) -> list[str]:
        return [xxhash.xxh64(self.cache[b].numpy().tobytes()).hexdigest() for b in block_ids]


def make_message(dst_block_ids, seed: int, compat: int = COMPAT) -> BlockMessage:
    gen = torch.Generator().manual_seed(seed)
    payload = torch.randint(0, 256, (len(dst_block_ids) * BLOCK_NBYTES,), dtype=torch.uint8,
                            generator=gen)
    index = encode_index(dst_block_ids, [0] * len(dst_block_ids))
    transfer_id = os.urandom(16)
    header = encode_header(transfer_id=transfer_id, compat_hash=compat, num_blocks=len(dst_block_ids),
                           index=index, payload=memoryview(payload.numpy()), **LAYOUT)
    return BlockMessage(transfer_id, header, index, payload)


def payload_digests(message: BlockMessage) -> list[str]:
    blocks = message.payload.view(-1, BLOCK_NBYTES)
    return [xxhash.xxh64(b.numpy().tobytes()).hexdigest() for b in blocks]


def os_threads() -> list[str]:
    """Names of this process's OS threads (Python's and the libraries' own)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # ended meanwhile
            pass
    return sorted(names)


def with_payload(message: BlockMessage, payload) -> BlockMessage:
    return BlockMessage(message.transfer_id, message.header, message.index, payload)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def num_pending(receiver) -> int:
    """Connections a receiver holds that have not proved the key yet (nccl: its gate's)."""
    gate = getattr(receiver, "gate", receiver)
    return gate.num_pending


# -- the receiving process -----------------------------------------------------------------------
def peer_main(backend: str) -> None:
    torch.set_num_threads(1)
    sink = TensorSink()
    transport = make_transport(backend)

    def handle(cmd: dict) -> dict:
        if cmd["cmd"] == "open":
            transport.key = bytes.fromhex(cmd["key"]) if cmd.get("key") else None
            return {"endpoint": transport.open_receiver(sink)}
        if cmd["cmd"] == "chunk_bytes":  # small, so that a test's few blocks span many chunks
            transfer_session.PAYLOAD_CHUNK_BYTES = cmd["value"] or CHUNK_BYTES
            _UcxChannel.sealed_chunk_bytes = cmd["value"] or UCX_CHUNK_BYTES  # ucx too
            return {}
        if cmd["cmd"] == "digests":
            return {"digests": sink.digests(cmd["blocks"])}
        if cmd["cmd"] == "stats":
            return {"threads": len(os_threads()), "rss_kib": rss_kib(),
                    "pending": sum(num_pending(r) for r in transport._receivers)}
        if cmd["cmd"] == "stall":
            sink.stall_s = cmd["seconds"]
            return {"num_stalled": sink.num_stalled}
        if cmd["cmd"] == "close":
            transport.close()
            transport.close()
            after_first = os_threads()
            again = make_transport(backend)  # a second open/close cycle must not add threads
            again.open_receiver(TensorSink())
            again.close()
            # helper threads of the second cycle may still be winding down: give them a moment
            settle_by = time.monotonic() + 3.0
            while len(os_threads()) > len(after_first) and time.monotonic() < settle_by:
                time.sleep(0.05)
            return {"threads": [t.name for t in threading.enumerate()],
                    "os_threads_first": after_first, "os_threads_second": os_threads()}
        raise ValueError(f"unknown command {cmd['cmd']!r}")

    serve_commands(handle)


class Peer(Child):
    """The receiving child process; every call waits with a deadline and must succeed."""

    def __init__(self, backend: str, log_path) -> None:
        super().__init__([sys.executable, __file__, backend], log_path)

    def call(self, cmd: str, timeout_s: float | None = None, **args) -> dict:
        reply = super().call(cmd, timeout_s, **args)
        assert reply["ok"], f"{cmd}: {reply['error']}"
        return reply


# -- fixtures --------------------------------------------------------------------------------------
class Link:
    def __init__(self, backend: str, peer: Peer, endpoint: str) -> None:
        self.backend, self.peer, self.endpoint = backend, peer, endpoint
        self.sender = make_transport(backend)

    def send(self, message: BlockMessage, deadline_s: float = DEADLINE_S) -> None:
        self.sender.send(self.endpoint, message, time.monotonic() + deadline_s)

    def digests(self, blocks) -> list[str]:
        return self.peer.call("digests", blocks=list(blocks))["digests"]


@pytest.fixture(scope="module", params=BACKENDS)
def link(request, tmp_path_factory):
    backend = request.param
    if backend == "ucx":
        pytest.importorskip("ucxx", reason="ucxx-cu12 is not installed")
    peer = Peer(backend, tmp_path_factory.mktemp(f"p2p-{backend}") / "peer.log")
    try:
        endpoint = peer.call("open", timeout_s=120)["endpoint"]
        link = Link(backend, peer, endpoint)
    except BaseException:
        peer.stop()
        raise
    yield link
    link.sender.close()
    peer.stop()


@pytest.fixture
def silent_listener():
    """A TCP listener that accepts connections and never says a word."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(timeout=5)
    for conn in held:
        conn.close()
    server.close()


# -- the cases ---------------------------------------------------------------------------------------
def test_receiver_binds_loopback(link):
    assert link.endpoint.startswith("127.0.0.1:")


def test_blocks_arrive_bit_identical(link):
    dst = [5, 17, 0, 31]
    message = make_message(dst, seed=1)
    assert link.digests(dst) == [xxhash.xxh64(bytes(BLOCK_NBYTES)).hexdigest()] * len(dst)
    link.send(message)
    assert link.digests(dst) == payload_digests(message)
    second = make_message([6, 7], seed=2)  # the connection is reused
    link.send(second)
    assert link.digests([6, 7]) == payload_digests(second)


def test_flipped_byte_is_refused_with_the_receivers_reason(link):
    dst = [8, 9]
    message = make_message(dst, seed=3)
    before = link.digests(dst)
    corrupt = message.payload.clone()
    corrupt[BLOCK_NBYTES + 123] ^= 0xFF
    with pytest.raises(TransferError, match="checksum"):
        link.send(with_payload(message, corrupt))
    assert link.digests(dst) == before
    link.send(message)  # the link survives a refusal
    assert link.digests(dst) == payload_digests(message)


def test_wrong_compatibility_hash_is_refused(link):
    dst = [10]
    message = make_message(dst, seed=4, compat=COMPAT + 1)
    before = link.digests(dst)
    with pytest.raises(TransferError, match="compatibility hash mismatch"):
        link.send(message)
    assert link.digests(dst) == before


def test_truncated_payload_is_refused_before_sending(link):
    message = make_message([11, 12], seed=5)
    with pytest.raises(TransferError, match="header says"):
        link.send(with_payload(message, message.payload[:-100]))


def test_silent_peer_hits_the_deadline(link, silent_listener):
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        link.sender.send(silent_listener, make_message([1], seed=6), time.monotonic() + 1.0)
    assert time.monotonic() - start < 1.0 + SLACK_S


def test_stalled_receiver_hits_the_deadline_then_recovers(link):
    stall_s = 2.5
    link.peer.call("stall", seconds=stall_s)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        link.send(make_message([13], seed=7), deadline_s=1.0)
    assert time.monotonic() - start < 1.0 + SLACK_S
    deadline = time.monotonic() + stall_s + 10
    while link.peer.call("stall", seconds=0.0)["num_stalled"]:  # until the stuck check returns
        assert time.monotonic() < deadline, "the stalled check never returned"
        time.sleep(0.05)
    message = make_message([14, 15], seed=8)
    link.send(message)  # a fresh connection / pair
    assert link.digests([14, 15]) == payload_digests(message)


def test_control_channel_admits_only_holders_of_the_transfer_key(link):
    key = os.urandom(32)
    endpoint = link.peer.call("open", key=key.hex())["endpoint"]  # a second receiver, keyed
    holder, stranger, anonymous = (make_transport(link.backend) for _ in range(3))
    holder.key, stranger.key = key, os.urandom(32)
    try:
        message = make_message([20, 21], seed=11)
        holder.send(endpoint, message, time.monotonic() + DEADLINE_S)
        assert link.digests([20, 21]) == payload_digests(message)
        for sender, blocks in ((stranger, [22]), (anonymous, [23])):
            before = link.digests(blocks)
            with pytest.raises((TransferError, TimeoutError)):
                sender.send(endpoint, make_message(blocks, seed=12), time.monotonic() + 3.0)
            assert link.digests(blocks) == before  # nothing landed
        # a keyed sender will not talk to a receiver that cannot prove the key either
        with pytest.raises((TransferError, TimeoutError)):
            holder.send(link.endpoint, make_message([24], seed=13), time.monotonic() + 3.0)
    finally:
        for sender in (holder, stranger, anonymous):
            sender.close()


class FlipProxy:
    """A TCP relay in front of a receiver that rewrites the first request's first destination
    block id on its way (an attacker on the path; it recomputes nothing), unless `flip` is
    False; either way `captured` keeps every byte the sender sent through it."""

    def __init__(self, target: str, flip: bool = True) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.flip = flip
        self.captured = bytearray()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.num_flipped = 0
        self._socks: list[socket.socket] = [self.server]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        try:
            client, _ = self.server.accept()
        except OSError:
            return
        upstream = socket.create_connection(self.target)
        self._socks += [client, upstream]
        threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()
        self._pump(client, upstream, True)

    def _pump(self, src: socket.socket, dst: socket.socket, rewrite: bool) -> None:
        seen = bytearray()
        try:
            while data := src.recv(1 << 16):
                if rewrite:
                    self.captured += data
                if rewrite and self.flip and not self.num_flipped:
                    seen += data
                    at = seen.find(_p2p.REQUEST_MAGIC)
                    index_at = at + _p2p.REQUEST.size + HEADER_SIZE
                    if at >= 0 and len(seen) > index_at:
                        start = len(seen) - len(data)
                        data = bytearray(data)
                        data[index_at - start] ^= 0x01  # block id 20 -> 21
                        self.num_flipped += 1
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()

    def close(self) -> None:
        for sock in self._socks:
            sock.close()


def test_a_control_frame_altered_on_the_path_is_refused(link):
    key = os.urandom(32)
    endpoint = link.peer.call("open", key=key.hex())["endpoint"]
    proxy, sender = FlipProxy(endpoint), make_transport(link.backend)
    sender.key = key
    try:
        before = link.digests([20, 21])
        with pytest.raises(TransferError, match="MAC"):
            sender.send(proxy.endpoint, make_message([20], seed=18), time.monotonic() + DEADLINE_S)
        assert proxy.num_flipped == 1
        assert link.digests([20, 21]) == before  # nothing landed, in either block
    finally:
        sender.close()
        proxy.close()


CHANNELS = {"ucx": ("pdserve.kvtransfer.backends.ucx", "_UcxChannel"),
            "nccl": ("pdserve.kvtransfer.backends.nccl", "_GroupChannel"),
            "tcp": ("pdserve.kvtransfer.backends.tcp", "_StreamChannel")}


def tap_channel(backend: str, monkeypatch) -> list[bytes]:
    """What the sender's payload channel is handed to put on the wire, send by send (a channel
    with its own `start_send` sends through it, a sealed chunk at a time)."""
    import importlib

    module, name = CHANNELS[backend]
    cls = getattr(importlib.import_module(module), name)
    method = "start_send" if "start_send" in vars(cls) else "send"
    sent, handed = getattr(cls, method), []

    def tapped(self, data, seq, deadline):
        handed.append(bytes(_payload.flat_bytes(data)))
        return sent(self, data, seq, deadline)

    monkeypatch.setattr(cls, method, tapped)
    return handed


def plaintext_runs_in(payload: torch.Tensor, wire: bytes) -> int:
    """How many of the payload's 16-byte runs (one every 509 bytes) appear in `wire`."""
    plain = payload.numpy().tobytes()
    return sum(plain[i:i + 16] in wire for i in range(0, len(plain) - 16, 509))


@pytest.mark.parametrize("keyed", [True, False])
def test_a_keyed_transfer_puts_no_plaintext_kv_on_the_wire(link, monkeypatch, keyed):
    """With a transfer key, a capture of everything the sender sends (its control connection
    through a tap on the path, which for tcp carries the payload too, and what its UCX or
    gloo channel is handed) holds no run of the KV bytes, and the blocks land bit-identical.
    Keyless (`--insecure-internal`), the same capture finds them: the tap sees the payload."""
    key = os.urandom(32) if keyed else None
    endpoint = link.peer.call("open", key=key.hex() if key else None)["endpoint"]
    proxy, sender = FlipProxy(endpoint, flip=False), make_transport(link.backend)
    sender.key = key
    handed = tap_channel(link.backend, monkeypatch)
    dst = [22, 23, 24] if keyed else [25, 26, 27]
    message = make_message(dst, seed=23 if keyed else 24)
    try:
        sender.send(proxy.endpoint, message, time.monotonic() + DEADLINE_S)
        assert link.digests(dst) == payload_digests(message)
        wire = bytes(proxy.captured) + b"".join(handed)
        assert len(wire) > message.payload.numel()  # the payload crossed the capture
        found = plaintext_runs_in(message.payload, wire)
        assert (found == 0) if keyed else (found > 90), found
    finally:
        sender.close()
        proxy.close()


def test_a_payload_altered_in_flight_is_refused_before_the_sink(link, monkeypatch):
    """With a transfer key, each sealed chunk's tag covers it as sent; bytes changed on the
    payload channel (UCX, gloo) fail it at the receiver, which refuses the transfer before its
    sink sees them and keeps the link."""
    key = os.urandom(32)
    endpoint = link.peer.call("open", key=key.hex())["endpoint"]
    sender = make_transport(link.backend)
    sender.key = key
    dst = [16, 17]
    message = make_message(dst, seed=19)
    before = link.digests(dst)
    seal = _payload.seal_chunk

    def altered_in_flight(cipher, chunk, plaintext, out):
        seal(cipher, chunk, plaintext, out)
        out[5] ^= 0x40

    monkeypatch.setattr(_payload, "seal_chunk", altered_in_flight)
    try:
        with pytest.raises(TransferError, match="payload failed its AEAD tag"):
            sender.send(endpoint, message, time.monotonic() + DEADLINE_S)
        assert link.digests(dst) == before
        monkeypatch.undo()
        sender.send(endpoint, message, time.monotonic() + DEADLINE_S)  # the link survives the refusal
        assert link.digests(dst) == payload_digests(message)
    finally:
        sender.close()


def test_an_earlier_payload_replayed_for_a_new_request_is_refused(link, monkeypatch):
    """The sealed bytes and tag of a payload that landed, replayed for the next request on the
    same link: refused (its nonce and associated data were the earlier request's), nothing of
    it lands, and the link carries the next honest payload."""
    key = os.urandom(32)
    endpoint = link.peer.call("open", key=key.hex())["endpoint"]
    sender = make_transport(link.backend)
    sender.key = key
    seal, kept = _payload.seal_chunk, []

    def replaying(cipher, chunk, plaintext, out):
        seal(cipher, chunk, plaintext, out)
        if not kept:
            kept.append(bytes(out))
        else:
            out[:] = kept[0]

    first, second = make_message([28], seed=25), make_message([29], seed=26)
    before = link.digests([29])
    monkeypatch.setattr(_payload, "seal_chunk", replaying)
    try:
        sender.send(endpoint, first, time.monotonic() + DEADLINE_S)
        with pytest.raises(TransferError, match="payload"):
            sender.send(endpoint, second, time.monotonic() + DEADLINE_S)
        assert link.digests([29]) == before
        monkeypatch.undo()
        sender.send(endpoint, second, time.monotonic() + DEADLINE_S)
        assert link.digests([28, 29]) == payload_digests(first) + payload_digests(second)
    finally:
        sender.close()


def test_a_payload_of_many_sealed_chunks_lands_and_a_chunk_altered_or_moved_is_refused(link, monkeypatch):
    """Sealed in chunks far smaller than the payload (both ends agree on the size), a keyed
    payload is sealed, moved and opened chunk by chunk over the real channel and lands
    bit-identical; a middle chunk altered in flight, or sealed for another place in the
    payload, is refused before the sink sees anything, and the link carries the next one."""
    chunk = 5000  # 8 blocks of 16 KiB: 27 chunks, the last one short
    key = os.urandom(32)
    endpoint = link.peer.call("open", key=key.hex())["endpoint"]
    link.peer.call("chunk_bytes", value=chunk)
    monkeypatch.setattr(transfer_session, "PAYLOAD_CHUNK_BYTES", chunk)
    monkeypatch.setattr(_UcxChannel, "sealed_chunk_bytes", chunk)  # whole by default
    sender = make_transport(link.backend)
    sender.key = key
    seal, faults = _payload.seal_chunk, []

    def faulty(cipher, k, plaintext, out):
        fault = faults[0] if faults else None
        seal(cipher, 14 if fault == "moved" and k == 13 else k, plaintext, out)
        if fault == "altered" and k == 13:
            out[100] ^= 0x08

    monkeypatch.setattr(_payload, "seal_chunk", faulty)
    dst = [0, 1, 2, 3, 4, 5, 6, 7]
    try:
        for fault, seed in (("altered", 31), ("moved", 32)):
            message = make_message(dst, seed=seed)
            before = link.digests(dst)
            faults[:] = [fault]
            with pytest.raises(TransferError, match="payload failed its AEAD tag"):
                sender.send(endpoint, message, time.monotonic() + DEADLINE_S)
            assert link.digests(dst) == before
            faults.clear()
            sender.send(endpoint, message, time.monotonic() + DEADLINE_S)  # the same link
            assert link.digests(dst) == payload_digests(message)
        assert len(sender._pool._links) == 1
    finally:
        sender.close()
        link.peer.call("chunk_bytes", value=None)  # back to the wire's


def test_idle_connections_cost_no_threads_and_leave_the_receiver_serving(link):
    """Connections that never answer the challenge: at most MAX_PENDING are held (no thread
    each), each for CHALLENGE_TIMEOUT_S; the rest are closed at once. A pair made before and a
    sender that comes after both get through. (nccl listens nowhere else before a pair:
    test_nccl_listeners floods the gloo devices' ports.)"""
    key = os.urandom(32)
    endpoint = link.peer.call("open", key=key.hex())["endpoint"]
    ports = [int(endpoint.rsplit(":", 1)[1])]
    holder = make_transport(link.backend)
    holder.key = key
    idle: list[socket.socket] = []
    try:
        holder.send(endpoint, make_message([28], seed=16), time.monotonic() + DEADLINE_S)
        before = link.peer.call("stats")
        for port in ports:
            idle += [socket.create_connection(("127.0.0.1", port)) for _ in range(NUM_IDLE)]
        during = link.peer.call("stats")
        assert during["pending"] <= _p2p.MAX_PENDING
        message = make_message([29, 30], seed=17)
        holder.send(endpoint, message, time.monotonic() + DEADLINE_S)  # while the flood is held
        assert link.digests([29, 30]) == payload_digests(message)
        deadline = time.monotonic() + _p2p.CHALLENGE_TIMEOUT_S + 10
        while (after := link.peer.call("stats"))["pending"]:
            assert time.monotonic() < deadline, f"idle connections still held: {after}"
            time.sleep(0.05)
        assert max(during["threads"], after["threads"]) <= before["threads"] + 1, (before, during, after)
        assert after["rss_kib"] - before["rss_kib"] < 64 * 1024, (before, after)
        late = make_transport(link.backend)
        late.key = key
        try:
            second = make_message([31], seed=20)
            late.send(endpoint, second, time.monotonic() + DEADLINE_S)
            assert link.digests([31]) == payload_digests(second)
        finally:
            late.close()
    finally:
        for sock in idle:
            sock.close()
        holder.close()


def test_unreachable_peer_is_a_transfer_error(link):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransferError, match="unreachable"):
        link.sender.send(f"127.0.0.1:{port}", make_message([1], seed=9), time.monotonic() + 5)


def test_connecting_ahead_opens_the_link_the_first_send_uses(link):
    if link.backend == "nccl":
        pytest.skip("nccl pairs on the first send")
    sender = make_transport(link.backend)
    try:
        sender.connect_ahead(link.endpoint, time.monotonic() + DEADLINE_S)
        message = make_message([12, 13], seed=11)
        sender.send(link.endpoint, message, time.monotonic() + DEADLINE_S)
        assert link.digests([12, 13]) == payload_digests(message)
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with pytest.raises(TransferError, match="unreachable"):
            sender.connect_ahead(f"127.0.0.1:{port}", time.monotonic() + 5)
    finally:
        sender.close()


def test_close_twice_leaves_no_threads(link):
    """Runs last for each backend: it closes both sides."""
    reply = link.peer.call("close")
    assert reply["threads"] == ["MainThread"]
    # UCX keeps a few process-wide helper threads once started; a second cycle adds none
    assert len(reply["os_threads_second"]) <= len(reply["os_threads_first"]), reply
    link.sender.close()
    link.sender.close()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("pdkv")]
    with pytest.raises(TransferError, match="closed"):
        link.send(make_message([1], seed=10))


if __name__ == "__main__":
    peer_main(sys.argv[1])

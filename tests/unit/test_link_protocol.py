"""The link protocol (`kvtransfer.backends._link`) over the in-memory channel of `link_fakes`:
real control connections on 127.0.0.1, real CacheSinks, no UCX and no gloo. Every fault the
transfer conformance suite plays on ucx and nccl is played here on the protocol alone, and
the control frames are altered, dropped, reordered and replayed in both directions."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from kvcaches import block_digests, make_caches, message_from_cache, tiny_layout
from link_fakes import FakeNetwork, FakeTransport
from support import wait_until

from pdserve.common.errors import TransferError
from pdserve.kvtransfer.backends import _p2p
from pdserve.kvtransfer.base import BlockMessage
from pdserve.kvtransfer.codec import as_bytes_view, new_transfer_id
from pdserve.kvtransfer.sink import CacheSink
from pdserve.kvtransfer.wire import HEADER_SIZE
from pdserve.security.transfer_session import Session, TamperedFrame

LAYOUT = tiny_layout(num_blocks=32)
DEADLINE_S = 5.0
SLACK_S = 4.0
KEY = os.urandom(32)


class Side:
    """A receiving transport over a CacheSink and a sending transport, one fake network."""

    def __init__(self, key: bytes | None = KEY, sender_key: bytes | None = KEY) -> None:
        self.network = FakeNetwork()
        self.caches, self.source = make_caches(LAYOUT), make_caches(LAYOUT, seed=3)
        self.sink = CacheSink(self.caches, LAYOUT)
        self.receiver = FakeTransport(self.network, key)
        self.endpoint = self.receiver.open_receiver(self.sink)
        self.sender = FakeTransport(self.network, sender_key)

    def message(self, src, dst, transfer_id=None, keys=None) -> BlockMessage:
        return message_from_cache(self.source, LAYOUT, transfer_id or new_transfer_id(), src, dst, keys)

    def send(self, message: BlockMessage, dst, deadline_s: float = DEADLINE_S, expect=True, keys=None) -> None:
        if expect:
            self.sink.expect(message.transfer_id, dst, time.monotonic() + 30, block_keys=keys)
        self.sender.send(self.endpoint, message, time.monotonic() + deadline_s)

    def landed(self, src, dst) -> bool:
        return block_digests(self.caches, dst) == block_digests(self.source, src)

    def assert_nothing_reserved(self) -> None:
        self.sink.expire_overdue()
        for tid in list(self.sink.pending_transfer_ids):
            self.sink.abort(tid)
        assert not self.sink.reserved_block_ids

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
        self.sink.close()


@pytest.fixture
def side():
    s = Side()
    yield s
    s.close()


def with_payload(message: BlockMessage, payload) -> BlockMessage:
    return BlockMessage(message.transfer_id, message.header, message.index, payload)


# -- what the conformance suite plays, on the protocol alone ----------------------------------------
def test_blocks_arrive_bit_identical_over_one_link(side):
    side.send(side.message([1, 2, 3], [4, 5, 6]), [4, 5, 6])
    side.send(side.message([7], [8]), [8])
    assert side.landed([1, 2, 3], [4, 5, 6]) and side.landed([7], [8])
    assert len(side.sender._pool._links) == 1 and side.network.num_sent == 2
    side.assert_nothing_reserved()


def test_payload_altered_on_the_channel_is_refused_before_the_sink_and_the_link_survives(side):
    side.network.alter = lambda data: bytes([data[0] ^ 1]) + data[1:]
    message = side.message([1, 2], [3, 4])
    with pytest.raises(TransferError, match="payload failed its AEAD tag"):
        side.send(message, [3, 4])
    assert block_digests(side.caches, [3, 4]) == block_digests(make_caches(LAYOUT), [3, 4])
    side.network.alter = None
    side.send(message, [3, 4], expect=False)  # the same reservation, the same link
    assert side.landed([1, 2], [3, 4]) and len(side.sender._pool._links) == 1
    side.assert_nothing_reserved()


@pytest.mark.parametrize("fault", ["swapped", "replayed"])
def test_sealed_chunks_swapped_or_replayed_on_the_channel_are_refused(side, monkeypatch, fault):
    """A payload sealed in many chunks lands whole; two of its chunks swapped on the channel,
    or a chunk of the link's previous payload delivered in place of this one's, fail their
    tags: the sink sees nothing, the link survives and carries the payload next time."""
    from link_fakes import FakeChannel

    from pdserve.security import transfer_session

    monkeypatch.setattr(transfer_session, "PAYLOAD_CHUNK_BYTES", 200)  # the tiny blocks span many
    first = side.message([1, 2, 3], [4, 5, 6])
    side.send(first, [4, 5, 6])
    assert side.landed([1, 2, 3], [4, 5, 6]) and side.network.num_sent > 10
    sent, seen, armed = FakeChannel.send, [], []

    def faulty(channel, data, seq, deadline):
        seen.append(bytes(data))
        chunk = len(seen) - 1 - armed[0] if armed else -1  # of the payload under attack
        if fault == "replayed" and chunk == 3:
            return sent(channel, seen[3], seq, deadline)  # the previous payload's chunk 3
        if fault == "swapped" and chunk == 2:
            return  # chunk 2 held back, then delivered in chunk 3's place, and 3 in 2's
        if fault == "swapped" and chunk == 3:
            sent(channel, seen[-2], seq, deadline)
            return sent(channel, data, seq - 1, deadline)
        return sent(channel, data, seq, deadline)

    monkeypatch.setattr(FakeChannel, "send", faulty)
    side.send(side.message([1, 2, 3], [7, 8, 9]), [7, 8, 9])  # the payload replay draws from
    armed.append(len(seen))
    message = side.message([1, 2, 3], [10, 11, 12])
    with pytest.raises(TransferError, match="payload failed its AEAD tag"):
        side.send(message, [10, 11, 12])
    assert block_digests(side.caches, [10, 11, 12]) == block_digests(make_caches(LAYOUT), [10, 11, 12])
    armed.clear()
    side.send(message, [10, 11, 12], expect=False)  # the same reservation, the same link
    assert side.landed([1, 2, 3], [10, 11, 12]) and len(side.sender._pool._links) == 1
    side.assert_nothing_reserved()


def test_keyless_a_flipped_byte_is_refused_by_the_sinks_checksum():
    s = Side(key=None, sender_key=None)
    try:
        message = s.message([1], [2])
        payload = bytearray(as_bytes_view(message.payload))
        payload[100] ^= 0xFF
        with pytest.raises(TransferError, match="checksum"):
            s.send(with_payload(message, bytes(payload)), [2])
        s.send(message, [2], expect=False)
        assert s.landed([1], [2])
    finally:
        s.close()


def test_sink_refusals_keep_the_link_and_leave_blocks_untouched(side):
    other = message_from_cache(side.source, tiny_layout(num_blocks=32, model_name="other"),
                               new_transfer_id(), [1], [9])
    with pytest.raises(TransferError, match="compatibility hash mismatch"):
        side.send(other, [9])
    swapped = side.message([2], [10], keys=[77])
    with pytest.raises(TransferError, match="other than the ones reserved"):
        side.send(swapped, [10], keys=[78])
    message = side.message([3], [11])
    side.send(message, [11])
    with pytest.raises(TransferError):  # a duplicate transfer id
        side.send(message, [11], expect=False)
    short = side.message([4, 5], [12, 13])
    with pytest.raises(TransferError, match="header says"):
        side.send(with_payload(short, bytes(as_bytes_view(short.payload))[:-100]), [12, 13])
    assert block_digests(side.caches, [9, 10, 12, 13]) == block_digests(make_caches(LAYOUT), [9, 10, 12, 13])
    assert len(side.sender._pool._links) == 1
    side.assert_nothing_reserved()


def test_a_receiver_deadline_releases_blocks_and_a_late_write_is_refused(side):
    message = side.message([1], [2])
    side.sink.expect(message.transfer_id, [2], time.monotonic() + 0.2)
    wait_until(lambda: (side.sink.expire_overdue(), not side.sink.reserved_block_ids)[1], "expiry")
    with pytest.raises(TransferError):
        side.send(message, [2], expect=False)
    side.assert_nothing_reserved()


@pytest.fixture
def silent_endpoint():
    server = socket.create_server(("127.0.0.1", 0))
    held, stop = [], threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    server.close()


@pytest.mark.parametrize("key", [KEY, None])
def test_an_unanswering_peer_hits_the_deadline(silent_endpoint, key):
    sender = FakeTransport(FakeNetwork(), key)
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            message = message_from_cache(make_caches(LAYOUT, seed=1), LAYOUT, new_transfer_id(), [1], [1])
            sender.send(silent_endpoint, message, time.monotonic() + 1.0)
    finally:
        sender.close()
    assert time.monotonic() - start < 1.0 + SLACK_S


@pytest.mark.parametrize("where", ["channel", "sink"])
def test_a_stall_hits_the_deadline_then_a_fresh_link_carries_the_next(side, monkeypatch, where):
    side.send(side.message([1], [1]), [1])
    stalled = threading.Event()
    if where == "channel":
        side.network.stall_s = 3.0
    else:  # a receiver that does not answer: its sink's check hangs
        check = side.sink.check
        monkeypatch.setattr(side.sink, "check", lambda *a: (stalled.wait(10), check(*a))[1])
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        side.send(side.message([2], [2]), [2], deadline_s=1.0)
    assert time.monotonic() - start < 1.0 + SLACK_S
    side.network.stall_s = 0.0
    stalled.set()
    monkeypatch.undo()
    side.send(side.message([3], [3]), [3])
    assert side.landed([3], [3])
    side.assert_nothing_reserved()


def test_only_holders_of_the_key_are_served(side):
    for key in (os.urandom(32), None):
        stranger = FakeTransport(side.network, key)
        try:
            with pytest.raises((TransferError, TimeoutError)):
                stranger.send(side.endpoint, side.message([1], [1]), time.monotonic() + 3.0)
        finally:
            stranger.close()
    unkeyed = Side(key=None, sender_key=KEY)  # a keyed sender will not talk to an unkeyed receiver
    try:
        with pytest.raises((TransferError, TimeoutError)):
            unkeyed.send(unkeyed.message([1], [1]), [1], deadline_s=3.0)
    finally:
        unkeyed.close()
    assert block_digests(side.caches, [1]) == block_digests(make_caches(LAYOUT), [1])
    side.assert_nothing_reserved()


def test_idle_connections_are_bounded_and_the_receiver_keeps_serving(side):
    side.send(side.message([1], [1]), [1])
    threads = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", side.receiver._receivers[0].port)) for _ in range(100)]
    try:
        (server,) = side.receiver._receivers
        wait_until(lambda: server.gate.num_pending == _p2p.MAX_PENDING, "the gate to fill")
        assert threading.active_count() <= threads  # no thread per waiting connection
        side.send(side.message([2], [2]), [2])  # the link made before still serves
        wait_until(lambda: server.gate.num_pending == 0, "the gate to time the idle out", timeout=15)
        late = FakeTransport(side.network, KEY)
        try:
            message = side.message([3], [3])
            side.sink.expect(message.transfer_id, [3], time.monotonic() + 30)
            late.send(side.endpoint, message, time.monotonic() + DEADLINE_S)
        finally:
            late.close()
        assert side.landed([2, 3], [2, 3])
    finally:
        for sock in idle:
            sock.close()


def test_unreachable_and_closed_are_transfer_errors(side):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransferError, match="unreachable"):
        side.sender.send(f"127.0.0.1:{port}", side.message([1], [1]), time.monotonic() + 3)
    side.sender.connect_ahead(side.endpoint, time.monotonic() + DEADLINE_S)
    assert list(side.sender._pool._links) == [side.endpoint]
    side.sender.close()
    side.sender.close()
    with pytest.raises(TransferError, match="closed"):
        side.sender.send(side.endpoint, side.message([1], [1]), time.monotonic() + 3)


def test_closing_leaves_no_threads():
    s = Side()
    s.send(s.message([1], [1]), [1])
    s.close()
    s.close()
    wait_until(lambda: not [t for t in threading.enumerate() if t.name.startswith("pdkv")], "pdkv threads to end")


# -- partitions: links that died unseen are replaced before use ---------------------------------
def test_a_channel_that_died_under_a_live_control_connection_is_replaced(side, monkeypatch):
    monkeypatch.setattr(_p2p, "PROBE_IDLE_S", 0.0)
    side.send(side.message([1], [1]), [1])
    link = side.sender._pool._links[side.endpoint]
    side.network.dead.add(link.channel.channel_id)
    side.send(side.message([2], [2]), [2])  # the probe fails, a fresh link carries it
    assert side.sender._pool._links[side.endpoint] is not link and link.channel.num_aborted == 1
    assert side.landed([2], [2])


def test_a_link_from_before_the_receiver_restarted_is_replaced(side, monkeypatch):
    monkeypatch.setattr(_p2p, "PROBE_IDLE_S", 0.0)
    side.send(side.message([1], [1]), [1])
    port = side.receiver._receivers[0].port
    side.receiver.close()
    side.receiver = FakeTransport(side.network, KEY, port=port)
    assert side.receiver.open_receiver(side.sink) == side.endpoint
    side.send(side.message([2], [2]), [2])
    assert side.landed([2], [2])


def test_a_hello_of_another_transport_is_refused(side):
    other = FakeTransport(side.network, KEY)
    other.name = "ucx"
    try:
        with pytest.raises(TransferError, match="not a pdserve fake sender"):
            other.send(side.endpoint, side.message([1], [1]), time.monotonic() + DEADLINE_S)
    finally:
        other.close()


def test_a_sender_of_the_previous_link_protocol_is_refused_at_its_hello(side, monkeypatch):
    """Link protocol 5 (a payload sealed whole, its tag in the request) and 6 (sealed in
    chunks) read a payload differently: a sender of 5 is refused at the hello, with both
    versions in the reason, before any request; the receiver goes on serving."""
    def previous_hello(session, transport, version, body):
        head = _p2p.HELLO.pack(_p2p.HELLO_MAGIC, 5, transport.encode(), version, len(body))
        return session.seal(head + body)

    monkeypatch.setattr(_p2p, "encode_hello", previous_hello)
    message = side.message([1], [1])
    with pytest.raises(TransferError, match="on link protocol 6 .it speaks fake 1 on 5"):
        side.send(message, [1])
    monkeypatch.undo()
    side.send(message, [1], expect=False)
    assert side.landed([1], [1])
    side.assert_nothing_reserved()


# -- control frames altered, dropped, reordered, replayed: in both directions ------------------------
class Tap:
    """Rewrites the sealed frames of one direction as they leave `Session.seal`: `pick(frame)`
    chooses the frame; `how` says what the path does to it. `drop` and `reorder` use a decoy
    sealed by the same session, standing for the frame the path dropped or held back."""

    def __init__(self, monkeypatch, from_sender: bool, pick, how: str) -> None:
        self.from_sender, self.pick, self.how = from_sender, pick, how
        self.seen: list[bytes] = []
        self.armed = False  # frames before are only recorded (a replay's source)
        self.num_done = 0
        seal = Session.seal

        def tapped(session: Session, frame: bytes) -> bytes:
            sealed = seal(session, frame)
            if session.is_sender != self.from_sender or not session.is_keyed:
                return sealed
            if self.num_done or not self.armed or not self.pick(frame):
                self.seen.append(sealed)
                return sealed
            self.num_done += 1
            if self.how == "alter":  # a request's first destination block id; a reply's ok byte
                at = _p2p.REQUEST.size + HEADER_SIZE if self.from_sender else 0
                return sealed[:at] + bytes([sealed[at] ^ 1]) + sealed[at + 1:]
            if self.how == "replay":
                return next(f for f in reversed(self.seen) if len(f) >= _p2p.REPLY.size and self.pick(f, True))
            decoy = sealed  # sealed first: the frame the path dropped / held back
            real = seal(session, frame)
            return real if self.how == "drop" else real + decoy

        monkeypatch.setattr(Session, "seal", tapped)


def is_request(frame: bytes, replay: bool = False) -> bool:
    return frame[:4] == _p2p.REQUEST_MAGIC


def is_refusal(frame: bytes, replay: bool = False) -> bool:
    """A refusing reply; for a replay, the ok verdict an earlier transfer got."""
    return frame[0] == (1 if replay else 0) and len(frame) >= _p2p.REPLY.size


@pytest.mark.parametrize("how", ["alter", "drop", "reorder", "replay"])
def test_a_request_tampered_on_its_way_to_the_receiver_is_refused(side, monkeypatch, how):
    tap = Tap(monkeypatch, from_sender=True, pick=is_request, how=how)
    side.send(side.message([1], [1]), [1])  # a request for `replay` to reuse
    tap.armed = True
    message = side.message([2, 3], [20, 21])
    with pytest.raises(TransferError, match="MAC"):
        side.send(message, [20, 21])
    assert tap.num_done == 1
    assert block_digests(side.caches, [20, 21, 22]) == block_digests(make_caches(LAYOUT), [20, 21, 22])
    monkeypatch.undo()
    (server,) = side.receiver._receivers
    wait_until(lambda: not server._threads, "the receiver to drop the link")
    side.send(message, [20, 21], expect=False)  # a fresh link
    assert side.landed([2, 3], [20, 21])
    side.assert_nothing_reserved()


@pytest.mark.parametrize("how", ["alter", "drop", "reorder", "replay"])
def test_a_refusal_tampered_on_its_way_back_is_not_taken_for_a_verdict(side, monkeypatch, how):
    """The receiver refuses a payload altered on the channel; the path turns that refusal into
    an "ok" (alter), replays an earlier "ok" in its place, drops a frame before it or swaps it
    with a later one. The sender must not report success, nor the receiver's reason: it sees a
    frame that failed its MAC."""
    tap = Tap(monkeypatch, from_sender=False, pick=is_refusal, how=how)
    side.send(side.message([1], [1]), [1])  # an "ok" verdict for `replay` to reuse
    tap.armed = True
    side.network.alter = lambda data: bytes([data[0] ^ 1]) + data[1:]
    message = side.message([2], [2])
    with pytest.raises(TamperedFrame):
        side.send(message, [2])
    assert tap.num_done == 1
    assert block_digests(side.caches, [2]) == block_digests(make_caches(LAYOUT), [2])
    monkeypatch.undo()
    side.network.alter = None
    assert not side.sender._pool._links  # a link whose frames failed is dropped
    side.send(message, [2], expect=False)
    assert side.landed([2], [2])
    side.assert_nothing_reserved()


def test_the_transfer_session_and_socket_admission_are_torch_and_grpc_free():
    import subprocess
    import sys

    code = ("import sys, pdserve.security.transfer_session, pdserve.security.socket_admission; "
            "print(sorted(m for m in ('torch', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out

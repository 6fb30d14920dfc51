"""The transfer listeners' accept path (`kvtransfer.backends._gate`) over real sockets: the
challenge before anything, a cap on connections awaiting it, a deadline, and an accept loop
that outlives whatever one connection does (its serving thread failing to start included)."""
from __future__ import annotations

import os
import random
import socket
import threading
import time

import pytest

from pdserve.common.errors import TransferError
from pdserve.kvtransfer.backends import _gate, _p2p, _payload
from pdserve.security import transfer_session
from support import wait_until

KEY = os.urandom(32)
WAIT_S = 10.0


@pytest.fixture
def gate():
    listener = socket.create_server(("127.0.0.1", 0), backlog=256)
    admitted: list[tuple[socket.socket, _p2p.Session]] = []
    failures = {"left": 0}

    def admit(sock, session):
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("can't start new thread")
        admitted.append((sock, session))

    g = _gate.Gate(listener, KEY, admit, name="test-gate", max_pending=8, timeout_s=0.5)
    g.admitted, g.failures = admitted, failures
    g.port = listener.getsockname()[1]
    yield g
    g.close(5.0)
    listener.close()
    for sock, _ in admitted:
        sock.close()


def connect_and_prove(port: int, key: bytes = KEY) -> tuple[socket.socket, _p2p.Session]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    deadline = time.monotonic() + WAIT_S
    return sock, _p2p.authenticate_receiver(sock, key, f"127.0.0.1:{port}", deadline)


def closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(WAIT_S)
    try:
        while data := sock.recv(64):  # a pending one gets its challenge first
            assert len(data) <= _p2p.PROOF_BYTES
        return True
    except ConnectionResetError:
        return True


def test_a_prover_is_admitted_with_the_session_both_sides_derive(gate):
    sock, ours = connect_and_prove(gate.port)
    wait_until(lambda: gate.admitted, "the prover was never admitted")
    theirs = gate.admitted[0][1]
    assert theirs.open(b"hello", ours.seal(b"hello")[5:]) == b"hello"
    sock.close()


def test_a_wrong_key_is_closed_and_never_admitted(gate):
    sock = socket.create_connection(("127.0.0.1", gate.port), timeout=WAIT_S)
    with pytest.raises((_p2p.PeerNotAuthenticated, ConnectionError)):
        _p2p.authenticate_receiver(sock, os.urandom(32), "gate", time.monotonic() + WAIT_S)
    assert closed_by_peer(sock)
    assert not gate.admitted
    sock.close()


def test_connections_past_the_cap_are_closed_at_once_and_idle_ones_time_out(gate):
    threads_before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", gate.port)) for _ in range(40)]
    try:
        wait_until(lambda: gate.num_refused >= 40 - 8, "connections past the cap were kept")
        assert gate.num_pending <= 8
        assert threading.active_count() == threads_before  # no thread per connection
        wait_until(lambda: gate.num_pending == 0, "idle connections outlived their deadline")
        assert all(closed_by_peer(sock) for sock in idle)
        sock, _ = connect_and_prove(gate.port)  # the gate still serves
        wait_until(lambda: gate.admitted, "a prover after the flood was never admitted")
        sock.close()
    finally:
        for sock in idle:
            sock.close()


def test_a_connection_that_cannot_be_served_does_not_end_the_accept_loop(gate):
    gate.failures["left"] = 2  # admit fails as a thread start does when the process is out of them
    first, second = connect_and_prove(gate.port)[0], connect_and_prove(gate.port)[0]
    assert closed_by_peer(first) and closed_by_peer(second)
    sock, _ = connect_and_prove(gate.port)
    wait_until(lambda: gate.admitted, "the accept loop ended after admit failed")
    sock.close()


def _seal(session, seq, header, index, plain: bytes) -> bytearray:
    """`plain` sealed as the link sends it: the chunks of `payload_chunks`, each its own tag."""
    cipher = session.payload_sealer(seq, header, index, len(plain))
    spans = transfer_session.payload_chunks(len(plain))
    wire = bytearray(spans[-1][1].stop)
    for k, (text, sealed) in enumerate(spans):
        _payload.seal_chunk(cipher, k, memoryview(plain)[text], memoryview(wire)[sealed])
    return wire


def _open(session, seq, header, index, wire: bytes, payload_len: int) -> bytes:
    """Each chunk opened in turn, as the receiver does; TamperedPayload at the first that fails."""
    cipher, out = session.payload_opener(seq, header, index, payload_len), bytearray(payload_len)
    for k, (text, sealed) in enumerate(transfer_session.payload_chunks(payload_len)):
        cipher.open(k, memoryview(wire)[sealed], memoryview(out)[text])
    return bytes(out)


def test_a_sealed_payload_opens_once_for_its_request_chunk_by_chunk_and_is_ciphertext_on_the_wire():
    """A keyed link's payload (AES-GCM under the link's own key, in chunks whose nonce is the
    chunk's number and the request's frame number): the bytes the channel carries hold no run
    of the plaintext; they open for the request that announced them; a flipped bit, two chunks
    swapped, the last chunk cut, another seq, another header, another length, the same bytes
    replayed for a later request, a session of another link and a keyless session are all
    refused."""
    def pair(challenge: bytes):
        return (_p2p.Session.derive(KEY, challenge, b"n" * 32, is_sender=True),
                _p2p.Session.derive(KEY, challenge, b"n" * 32, is_sender=False))

    chunk = transfer_session.PAYLOAD_CHUNK_BYTES
    sender, receiver = pair(b"c" * 32)
    plain = random.Random(3).randbytes(2 * chunk + 1000)  # three chunks, the last one short
    header, index = b"h" * 72, b"i" * 16
    wire = _seal(sender, 5, header, index, plain)
    receiver.open(*_split(sender.seal(b"request")))  # the request frame that announces it
    assert len(wire) == len(plain) + 3 * _p2p.PAYLOAD_TAG_BYTES
    assert not any(plain[i:i + 16] in wire for i in range(0, len(plain) - 16, 99_991))
    assert _open(receiver, 5, header, index, wire, len(plain)) == plain

    flipped = bytearray(wire)
    flipped[chunk + 40000] ^= 0x02
    swapped = wire[chunk + 16:2 * (chunk + 16)] + wire[:chunk + 16] + wire[2 * (chunk + 16):]
    for args in ((5, header, index, flipped, len(plain)), (5, header, index, swapped, len(plain)),
                 (6, header, index, wire, len(plain)), (5, b"H" * 72, index, wire, len(plain)),
                 (5, header, index, wire[:2 * (chunk + 16)], 2 * chunk)):
        with pytest.raises(_p2p.TamperedPayload, match="AEAD"):
            _open(receiver, *args)
    receiver.open(*_split(sender.seal(b"a later request")))  # the same bytes replayed for it
    with pytest.raises(_p2p.TamperedPayload, match="AEAD"):
        _open(receiver, 5, header, index, wire, len(plain))
    _, other = pair(b"d" * 32)
    other.open(*_split(pair(b"d" * 32)[0].seal(b"request")))
    with pytest.raises(_p2p.TamperedPayload, match="AEAD"):
        _open(other, 5, header, index, wire, len(plain))
    keyless = _p2p.Session.derive(None, b"", b"", is_sender=True)
    with pytest.raises(TransferError, match="keyed"):
        keyless.payload_sealer(5, header, index, len(plain))
    assert _payload.chunk_spans(keyless, len(plain)) == [(slice(0, len(plain)),) * 2]


def _split(frame: bytes) -> tuple[bytes, bytes]:
    return frame[:-_p2p.TAG_BYTES], frame[-_p2p.TAG_BYTES:]

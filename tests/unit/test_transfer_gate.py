"""The transfer listeners' accept path (`kvtransfer.backends._gate`) over real sockets: the
challenge before anything, a cap on connections awaiting it, a deadline, and an accept loop
that outlives whatever one connection does (its serving thread failing to start included)."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from pdserve.kvtransfer.backends import _gate, _p2p
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


def test_a_device_payload_tag_covers_the_digest_and_is_bound_to_its_mode():
    """The nccl device-direct tag (Poly1305 over the payload's keyed digest, `on_device`)
    verifies on the same bytes, refuses a flipped bit, a replay under another sequence number
    and a check in the other mode; here on CPU tensors (the same code a GPU runs, torch path)."""
    import torch

    from pdserve.common.errors import TransferError

    sender = _p2p.Session.derive(KEY, b"c" * 32, b"n" * 32, is_sender=True)
    receiver = _p2p.Session.derive(KEY, b"c" * 32, b"n" * 32, is_sender=False)
    payload = torch.randint(0, 256, (3 * 16384 + 8,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    header, index = b"h" * 72, b"i" * 16
    tag = _p2p.payload_tag(sender, 5, header, index, payload, on_device=True)
    _p2p.check_payload(receiver, 5, header, index, payload.clone(), tag, on_device=True)
    assert tag != _p2p.payload_tag(sender, 5, header, index, payload)  # the host mode MACs the bytes themselves
    altered = payload.clone()
    altered[40000] ^= 0x02
    for args, mode in (((5, header, index, altered), True), ((6, header, index, payload), True),
                       ((5, header, index, payload), False)):
        with pytest.raises(TransferError, match="payload MAC mismatch"):
            _p2p.check_payload(receiver, *args, tag, on_device=mode)

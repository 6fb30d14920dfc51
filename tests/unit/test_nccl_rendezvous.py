"""The nccl pair's rendezvous pieces over real sockets: `_rendezvous.PairStore` (a process
group's store carried by the authenticated control connection) and `security.socket_admission` (the BPF
filters that close a gloo device's listener to everyone but the peer, then to everyone)."""
from __future__ import annotations

import datetime
import os
import socket
import struct
import threading
import time

import pytest

from pdserve.kvtransfer.backends import _p2p, _rendezvous
from pdserve.security import socket_admission as _listeners

KEY = os.urandom(32)
WAIT_S = 5.0


@pytest.fixture
def pair():
    """Two stores, rank 0 and rank 1, over one authenticated connection."""
    left, right = socket.socketpair()
    challenge, nonce = os.urandom(32), os.urandom(32)
    deadline = time.monotonic() + WAIT_S
    stores = (_rendezvous.PairStore(left, _p2p.Session.derive(KEY, challenge, nonce, True), deadline),
              _rendezvous.PairStore(right, _p2p.Session.derive(KEY, challenge, nonce, False), deadline))
    yield stores, (left, right)
    left.close()
    right.close()


def finish_both(stores) -> None:
    done = threading.Thread(target=stores[1].finish, args=(time.monotonic() + WAIT_S,))
    done.start()
    stores[0].finish(time.monotonic() + WAIT_S)
    done.join(WAIT_S)


def test_a_key_set_on_one_side_is_read_on_the_other_in_any_order(pair):
    (zero, one), _ = pair
    zero.set("other", "text")
    zero.set("0/0", b"address of rank 0")
    one.set("0/1", b"address of rank 1")
    assert not one.check(["other"])
    assert one.get("0/0") == b"address of rank 0"  # reads past "other", keeps it
    assert one.check(["other"]) and one.get("other") == b"text"
    assert zero.get("0/1") == b"address of rank 1"
    assert zero.published == [b"text", b"address of rank 0"]


def test_after_finish_the_connection_is_in_sync_and_the_store_local(pair):
    (zero, one), (left, right) = pair
    zero.set("unread", b"x")  # never asked for: finish reads past it
    finish_both((zero, one))
    assert not zero.is_open and not one.is_open
    sessions = _p2p.Session.derive(KEY, b"c", b"n", True), _p2p.Session.derive(KEY, b"c", b"n", False)
    left.sendall(sessions[0].seal(b"next frame"))
    assert _p2p.recv_sealed(right, sessions[1], 10, time.monotonic() + WAIT_S) == b"next frame"
    zero.set("late", b"stays here")
    assert zero.get("late") == b"stays here" and not one.check(["late"])
    with pytest.raises(_rendezvous.RendezvousError, match="never came"):
        one.get("late")


def test_a_frame_over_the_bounds_is_refused_before_its_bytes_are_read(pair):
    (_, one), (left, _) = pair
    left.sendall(_rendezvous.RDV.pack(_rendezvous.RDV_MAGIC, _rendezvous.KIND_KEY, 3,
                                      _rendezvous.MAX_VALUE + 1) + b"key")
    with pytest.raises(_rendezvous.RendezvousError, match="malformed"):
        one.get("key")


def test_a_frame_without_the_sessions_tag_is_refused(pair):
    (_, one), (left, _) = pair
    frame = _rendezvous.RDV.pack(_rendezvous.RDV_MAGIC, _rendezvous.KIND_KEY, 1, 1) + b"kv"
    left.sendall(frame + bytes(_p2p.TAG_BYTES))
    with pytest.raises(_p2p.TamperedFrame):
        one.get("k")


def test_a_peer_publishing_too_many_keys_is_refused(pair):
    (zero, one), _ = pair
    for i in range(_rendezvous.MAX_KEYS + 1):
        zero.set(f"k{i}", b"v")
    with pytest.raises(_rendezvous.RendezvousError, match="more than"):
        one.get(f"k{_rendezvous.MAX_KEYS}")


def test_a_silent_peer_is_a_timeout(pair):
    (_, one), _ = pair
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        one.wait(["never"], datetime.timedelta(seconds=0.3))
    assert time.monotonic() - start < 0.3 + 2.0


# -- the listener filters ------------------------------------------------------------------------
def gloo_like_address(sock: socket.socket) -> bytes:
    """What gloo publishes for a listener: a sockaddr_storage, sequence number, junk."""
    host, port = sock.getsockname()
    sockaddr = struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_aton(host)
    return sockaddr.ljust(128, b"\0") + os.urandom(42)


def connects(port: int, source: str) -> bool:
    with socket.socket() as client:
        client.bind((source, 0))
        client.settimeout(0.5)
        try:
            client.connect(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_a_listener_admits_only_the_peer_then_nobody():
    with socket.create_server(("127.0.0.1", 0)) as listener, socket.create_server(("127.0.0.1", 0)) as other:
        port, published = listener.getsockname()[1], [gloo_like_address(listener)]
        found = _listeners.own_listeners(published)
        assert [s.getsockname() for s in found] == [listener.getsockname()]
        for sock in found:
            sock.close()
        assert _listeners.admit_only(published, "127.0.0.2") == 1
        assert connects(port, "127.0.0.2") and not connects(port, "127.0.0.1")
        assert _listeners.admit_none(published) == 1
        assert not connects(port, "127.0.0.2") and not connects(port, "127.0.0.1")
        assert connects(other.getsockname()[1], "127.0.0.1")  # another listener is untouched
        listener.settimeout(0.1)
        accepted = listener.accept()[0]  # the one the peer made before
        accepted.close()
        with pytest.raises(TimeoutError):
            listener.accept()


def test_an_ipv6_peer_gets_its_own_program():
    program = _listeners._source_is("fd00::2")
    assert len(program) == 4 * 2 + 2 and program[-2:] == [(_listeners.RET_K, 0, 0, _listeners.ACCEPT),
                                                          (_listeners.RET_K, 0, 0, _listeners.DROP)]
    assert _listeners._source_is("::ffff:10.0.0.2") is None  # arrives with an IPv4 header

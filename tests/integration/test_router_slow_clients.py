"""The router's HTTP port under slow clients (security.slow_clients): a few hundred
connections that send part of their headers and then a byte now and then are all closed
within the header deadline, while /health answers in under a second throughout; a
connection idle after its response is closed; one past the connection bound is closed at
once; past half the bound waiting for headers, the oldest waiting one makes room. Real
sockets, a real router."""
from __future__ import annotations

import socket
import threading
import time

import httpx
from router_fakes import wait_until

HEADER_TIMEOUT_S = 2.0
NUM_SLOW = 300


def _open_slow(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    return sock


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(0)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_slow_headers_are_closed_at_the_deadline_while_health_answers(make_cluster):
    cluster = make_cluster(http_header_timeout_s=HEADER_TIMEOUT_S, http_idle_timeout_s=1.0)
    port = int(cluster.http.rsplit(":", 1)[1])
    slow = [_open_slow(port) for _ in range(NUM_SLOW)]
    opened = time.monotonic()
    stop = threading.Event()

    def drip() -> None:  # the attacker's pace: one more header byte per connection every 0.5 s
        while not stop.wait(0.5):
            for sock in slow:
                try:
                    sock.sendall(b"X")
                except OSError:
                    pass

    threading.Thread(target=drip, daemon=True).start()
    try:
        with httpx.Client(base_url=cluster.http) as client:
            while time.monotonic() - opened < HEADER_TIMEOUT_S * 0.8:  # all held: /health still answers fast
                started = time.monotonic()
                assert client.get("/health", timeout=1.0).status_code == 200
                assert time.monotonic() - started < 1.0
        wait_until(lambda: all(_closed(sock) for sock in slow), "slow connections closed", HEADER_TIMEOUT_S + 3.0)
        assert time.monotonic() - opened < HEADER_TIMEOUT_S + 3.0
    finally:
        stop.set()
        for sock in slow:
            sock.close()


def test_an_idle_connection_is_closed_after_its_response(make_cluster):
    cluster = make_cluster(http_header_timeout_s=30.0, http_idle_timeout_s=0.5)
    port = int(cluster.http.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(5.0)  # closed once idle, long before the header deadline (else: TimeoutError)
        received = b""
        while chunk := sock.recv(4096):
            received += chunk
        assert received.startswith(b"HTTP/1.1 200") and received.endswith(b"}")


def test_the_connection_bound_and_the_oldest_waiting_making_room(make_cluster):
    cluster = make_cluster(http_header_timeout_s=30.0, http_max_connections=8)
    port = int(cluster.http.rsplit(":", 1)[1])
    waiting = [_open_slow(port) for _ in range(4)]  # half the bound wait for their headers
    try:
        newest = _open_slow(port)  # one more waiting: the oldest waiting is closed
        waiting.append(newest)
        wait_until(lambda: _closed(waiting[0]), "the oldest waiting connection closed")
        assert not any(_closed(sock) for sock in waiting[1:])
        assert httpx.get(f"{cluster.http}/health", timeout=2.0).status_code == 200  # headers at once: served
    finally:
        for sock in waiting:
            sock.close()


def test_past_the_bound_a_connection_is_closed_at_once(make_cluster):
    cluster = make_cluster(http_header_timeout_s=30.0, http_max_connections=4)
    port = int(cluster.http.rsplit(":", 1)[1])
    held = []
    try:
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", port))  # an open request: counted, not waiting
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            held.append(sock)
        held += [_open_slow(port) for _ in range(2)]  # the bound is full
        wait_until(lambda: not any(_closed(s) for s in held), "held connections")
        extra = socket.create_connection(("127.0.0.1", port))
        held.append(extra)
        extra.settimeout(5.0)
        try:
            assert extra.recv(1) == b""
        except ConnectionResetError:
            pass
    finally:
        for sock in held:
            sock.close()

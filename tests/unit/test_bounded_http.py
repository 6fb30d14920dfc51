"""common.bounded_http: the side ports' server (metrics, the chart's enroller) binds an IPv6
host as IPv6 (the chart's `listenHost: "::"`), and a connection that never sends its request
is cut at its deadline, freeing its slot."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from pdserve.common.bounded_http import BoundedHandler, BoundedServer


class _Ok(BoundedHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.reply(200, b"ok", "text/plain")

    def log_message(self, format: str, *args) -> None:  # noqa: A002
        pass


def _serve(host: str) -> BoundedServer:
    server = BoundedServer((host, 0), _Ok, max_connections=1, deadline_s=0.5, io_timeout_s=5.0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


def _get(host: str, port: int) -> bytes:
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        return s.recv(1024)


def test_an_ipv6_host_binds_ipv6():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        server = _serve("::1")
    except OSError as exc:
        pytest.skip(f"::1 cannot be bound here: {exc}")
    try:
        assert server.socket.family == socket.AF_INET6
        assert _get("::1", server.server_address[1]).startswith(b"HTTP/1.0 200")
    finally:
        server.shutdown()
        server.server_close()


def test_a_silent_connection_is_cut_at_its_deadline_and_frees_its_slot():
    server = _serve("127.0.0.1")
    port = server.server_address[1]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as silent:
            deadline = time.monotonic() + 5
            while server.num_serving != 1:  # the one slot is held by the silent client
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert silent.recv(1) == b""  # cut at 0.5 s, not at the 5 s read timeout
        deadline = time.monotonic() + 5
        while server.num_serving:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert _get("127.0.0.1", port).startswith(b"HTTP/1.0 200")
    finally:
        server.shutdown()
        server.server_close()

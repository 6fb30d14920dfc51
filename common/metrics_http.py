"""A Prometheus /metrics listener of its own (a worker's `--metrics-port`, the router's extra
`--metrics-port`): GET /metrics only, a bearer token when one is set, and bounded work
before it is checked: at most `max_connections` handler threads (one more connection is
closed at once, where prometheus_client's server starts a thread per connection) and
`request_timeout_s` for a client to send its request line and headers, in all (a byte now
and then does not extend it: security.slow_clients' rule)."""
from __future__ import annotations

import contextlib
import hmac
import http.server
import logging
import socket
import threading
from typing import Callable

from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16
REQUEST_TIMEOUT_S = 5.0


class _Handler(http.server.BaseHTTPRequestHandler):
    server: "_Server"

    @property
    def timeout(self) -> float:  # read by setup(): a client that does not send its request in time is dropped
        return self.server.request_timeout_s

    def setup(self) -> None:
        super().setup()
        self._deadline = threading.Timer(self.server.request_timeout_s, self._headers_late)
        self._deadline.daemon = True
        self._deadline.start()

    def parse_request(self) -> bool:  # reads the headers after the request line
        parsed = super().parse_request()
        self._deadline.cancel()  # the request line and headers are in
        return parsed

    def finish(self) -> None:
        self._deadline.cancel()
        super().finish()

    def _headers_late(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)  # the handler's read ends; the thread is freed

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?", 1)[0] != "/metrics":
            self._reply(404, b"not found\n", "text/plain")
        elif not self.server.authorized(self.headers.get("Authorization")):
            self._reply(401, b"unauthorized: send Authorization: Bearer <token>\n", "text/plain",
                        {"WWW-Authenticate": "Bearer"})
        else:
            self._reply(200, self.server.render(), CONTENT_TYPE_LATEST)

    def _reply(self, status: int, body: bytes, content_type: str, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - scrapes are not logged
        pass


class _Server(http.server.HTTPServer):
    daemon_threads = True
    # A burst of connections waits in the kernel's queue to be accepted (and closed when every
    # slot is busy) instead of having its SYNs dropped and retried seconds later.
    request_queue_size = 128

    def __init__(self, address, render: Callable[[], bytes], token: str | None, max_connections: int,
                 request_timeout_s: float) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _Handler)
        self.render = render
        self.request_timeout_s = request_timeout_s
        self._token = f"Bearer {token}".encode() if token else None
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self.num_serving = 0  # connections held by a handler thread now

    def authorized(self, header: str | None) -> bool:
        return self._token is None or hmac.compare_digest((header or "").encode(), self._token)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # busy: this scrape fails, the next one gets in
            return
        self._count(+1)
        try:
            threading.Thread(target=self._serve, args=(request, client_address), daemon=True,
                             name="pdserve-metrics").start()
        except RuntimeError as exc:  # out of threads: drop this one, keep serving
            log.warning("metrics: cannot serve a scrape: %s", exc)
            self._count(-1)
            self._slots.release()
            self.shutdown_request(request)

    def _serve(self, request, client_address) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - one client's failure is its own
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._count(-1)
            self._slots.release()

    def _count(self, delta: int) -> None:
        with self._lock:
            self.num_serving += delta

    def handle_error(self, request, client_address) -> None:
        log.debug("metrics: a scrape from %s failed", client_address)


class MetricsServer:
    """Serves `render()` (Prometheus text) on host:port until `shutdown()`; with `token`,
    only to `Authorization: Bearer <token>`."""

    def __init__(self, host: str, port: int, render: Callable[[], bytes], token: str | None = None,
                 max_connections: int = MAX_CONNECTIONS, request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self._server = _Server((host, port), render, token, max_connections, request_timeout_s)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="pdserve-metrics-accept",
                                        daemon=True)
        self._thread.start()

    @property
    def num_serving(self) -> int:
        """Connections a handler thread holds now (at most `max_connections`)."""
        return self._server.num_serving

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

"""A small threaded HTTP server for a side port (a metrics listener, the chart's enroller) with
bounded work before anything is checked (security.slow_clients' rule for such ports).

- At most `max_connections` handler threads: one more connection is closed at once (where
  http.server starts a thread per connection).
- Each connection has a deadline, `deadline_s` after it opened, whatever it sends meanwhile
  (a byte now and then does not extend it): its socket is shut down, the handler's read
  ends and its thread is freed. A handler may meet the deadline earlier (`deadline_met`: a
  metrics port only bounds the request line and headers).
- Each socket read and write has `io_timeout_s`.
- An IPv6 host (one with a ':') binds an IPv6 socket.
"""
from __future__ import annotations

import contextlib
import http.server
import logging
import socket
import threading

log = logging.getLogger(__name__)


class BoundedHandler(http.server.BaseHTTPRequestHandler):
    server: "BoundedServer"

    @property
    def timeout(self) -> float:  # read by setup(): every read and write of the connection
        return self.server.io_timeout_s

    def setup(self) -> None:
        super().setup()
        self.expired = threading.Event()  # set when the deadline cut the connection
        self._deadline = threading.Timer(self.server.deadline_s, self._cut)
        self._deadline.daemon = True
        self._deadline.start()

    def deadline_met(self) -> None:
        self._deadline.cancel()

    def finish(self) -> None:
        self._deadline.cancel()
        super().finish()

    def _cut(self) -> None:
        self.expired.set()
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def reply(self, status: int, body: bytes, content_type: str, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)


class BoundedServer(http.server.HTTPServer):
    daemon_threads = True
    # A burst of connections waits in the kernel's queue to be accepted (and closed when every
    # slot is busy) instead of having its SYNs dropped and retried seconds later.
    request_queue_size = 128

    def __init__(self, address, handler: type[BoundedHandler], max_connections: int, deadline_s: float,
                 io_timeout_s: float, name: str = "pdserve-http") -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)
        self.deadline_s, self.io_timeout_s, self._name = deadline_s, io_timeout_s, name
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self.num_serving = 0  # connections held by a handler thread now

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # busy: this connection is closed unserved
            return
        self._count(+1)
        try:
            threading.Thread(target=self._serve, args=(request, client_address), daemon=True,
                             name=self._name).start()
        except RuntimeError as exc:  # out of threads: drop this one, keep serving
            log.warning("%s: cannot serve a connection: %s", self._name, exc)
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
        log.debug("%s: a request from %s failed", self._name, client_address)

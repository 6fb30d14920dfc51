"""A Prometheus /metrics listener of its own (a worker's `--metrics-port`, the router's extra
`--metrics-port`): GET /metrics only, a bearer token when one is set, and bounded work
before it is checked: at most `max_connections` handler threads (one more connection is
closed at once, where prometheus_client's server starts a thread per connection) and
`request_timeout_s` for a client to send its request line and headers, in all (a byte now
and then does not extend it: security.slow_clients' rule)."""
from __future__ import annotations

import hmac
import threading
from typing import Callable

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdserve.common.bounded_http import BoundedHandler, BoundedServer

MAX_CONNECTIONS = 16
REQUEST_TIMEOUT_S = 5.0


class _Handler(BoundedHandler):
    server: "_Server"

    def parse_request(self) -> bool:  # reads the headers after the request line
        parsed = super().parse_request()
        self.deadline_met()  # the request line and headers are in
        return parsed

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?", 1)[0] != "/metrics":
            self.reply(404, b"not found\n", "text/plain")
        elif not self.server.authorized(self.headers.get("Authorization")):
            self.reply(401, b"unauthorized: send Authorization: Bearer <token>\n", "text/plain",
                       {"WWW-Authenticate": "Bearer"})
        else:
            self.reply(200, self.server.render(), CONTENT_TYPE_LATEST)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - scrapes are not logged
        pass


class _Server(BoundedServer):
    def __init__(self, address, render: Callable[[], bytes], token: str | None, max_connections: int,
                 request_timeout_s: float) -> None:
        super().__init__(address, _Handler, max_connections, deadline_s=request_timeout_s,
                         io_timeout_s=request_timeout_s, name="pdserve-metrics")
        self.render = render
        self._token = f"Bearer {token}".encode() if token else None

    def authorized(self, header: str | None) -> bool:
        return self._token is None or hmac.compare_digest((header or "").encode(), self._token)


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

"""Slow clients on an HTTP port: connections that open and then send their request's headers
a byte at a time, or never, or stay idle between requests.

Threat: a client (no key needed: nothing is checked before the headers) holding thousands of
connections open at no cost to itself until the port, the process's descriptors or its
memory run out, and `/health` with them.

Rule: a connection must finish each request's headers within `header_timeout_s` of being
opened (or of its previous response), whatever it sends meanwhile, and is closed when idle
for `idle_timeout_s` between requests; at most `max_connections` are open (one more is
closed at once), of which at most `max_awaiting_headers` wait for their headers: one more
closes the one waiting longest, so a client that sends its headers at once always gets in.
`ConnectionGuard` keeps the count; the uvicorn protocol that obeys it is an adapter in
`pdserve.router.http_guard`, and a metrics port's handler threads keep the same deadline
(`pdserve.common.metrics_http`).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable


@dataclass(frozen=True, slots=True)
class HttpLimits:
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 5.0
    max_connections: int = 4096

    def __post_init__(self) -> None:
        if not (self.header_timeout_s > 0 and self.idle_timeout_s > 0 and self.max_connections >= 2):
            raise ValueError("HTTP limits: timeouts > 0 and max_connections >= 2")

    @property
    def max_awaiting_headers(self) -> int:
        return self.max_connections // 2


class ConnectionGuard:
    """The open connections of one port and those among them waiting for their headers
    (oldest first). Single-threaded: one event loop's callbacks call it."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self._open: set[Hashable] = set()
        self._awaiting: OrderedDict[Hashable, None] = OrderedDict()

    @property
    def num_open(self) -> int:
        return len(self._open)

    @property
    def num_awaiting(self) -> int:
        return len(self._awaiting)

    def opened(self, connection: Hashable) -> bool:
        """Count a new connection; False when the port is full (close it, uncounted)."""
        if len(self._open) >= self.limits.max_connections:
            return False
        self._open.add(connection)
        return True

    def awaiting(self, connection: Hashable) -> Hashable | None:
        """`connection` waits for a request's headers now; the connection to close to make
        room (the one waiting longest), or None."""
        self._awaiting[connection] = None
        self._awaiting.move_to_end(connection)
        if len(self._awaiting) > self.limits.max_awaiting_headers:
            oldest, _ = self._awaiting.popitem(last=False)
            return oldest
        return None

    def answered(self, connection: Hashable) -> None:
        """`connection`'s headers arrived."""
        self._awaiting.pop(connection, None)

    def closed(self, connection: Hashable) -> None:
        self._awaiting.pop(connection, None)
        self._open.discard(connection)

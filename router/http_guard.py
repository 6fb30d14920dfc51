"""uvicorn's h11 protocol under `security.slow_clients`' rule: a header deadline from each
connection's start and from each response's end, the port's connection bound, and the
oldest connection still waiting for its headers closed when too many wait. uvicorn's own
`timeout_keep_alive` closes idle connections (it starts no timer before a first request,
and stops its timer at the first byte of the next one: the header deadline covers both)."""
from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.security.slow_clients import ConnectionGuard, HttpLimits

log = logging.getLogger("pdserve.router.http")


class GuardedH11Protocol(H11Protocol):
    """One connection; `guard` is its port's (set on the subclass `guarded_protocol` makes)."""

    guard: ConnectionGuard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._waiting_cycle: object = None
        if not self.guard.opened(self):
            transport.abort()  # the port is full: this one is not served
            self._counted = False
            return
        self._counted = True
        super().connection_made(transport)
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._counted:
            return
        self._disarm()
        self.guard.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._counted:
            return
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self._header_timer is not None and self.cycle is not self._waiting_cycle:
            self._disarm()  # a request's headers arrived: its cycle began

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._header_timer is None and self.cycle is not None \
                and self.cycle.response_complete:
            self._await_headers()  # the next request's headers are due within the deadline too

    def _await_headers(self) -> None:
        self._waiting_cycle = self.cycle
        self._header_timer = self.loop.call_later(self.guard.limits.header_timeout_s, self._headers_late)
        evicted = self.guard.awaiting(self)
        if evicted is not None:
            evicted._close_unanswered()

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self.guard.answered(self)

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.cycle is self._waiting_cycle:
            self._close_unanswered()

    def _close_unanswered(self) -> None:
        """Close a connection whose headers did not come in time (or that made room)."""
        self._disarm()
        if not self.transport.is_closing():
            self.transport.abort()


def guarded_protocol(limits: HttpLimits) -> type[GuardedH11Protocol]:
    """The protocol class of one port: its connections share one `ConnectionGuard`."""
    return type("PortH11Protocol", (GuardedH11Protocol,), {"guard": ConnectionGuard(limits)})

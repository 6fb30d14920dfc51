"""The authenticated-first accept path of a transfer listener (`_link.ControlServer`).

One thread accepts connections and runs every pending challenge without blocking (a
selector), so a connection that has not proved the transfer key costs a socket and a few
dozen bytes, never a thread. At most `max_pending` connections wait for their answer (one
more is closed at once), each at most `timeout_s`. A connection that proves the key is handed
to `admit(sock, session)` on the gate's thread; `admit` starts whatever serves it (or refuses
it) and must not block. Without a key there is no challenge: a connection waits, on the same
bounds, until it has sent its first bytes. Nothing a connection does (a reset, a bad answer,
`admit` failing, a thread that cannot start) ends the accept loop.
"""
from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from pdserve.kvtransfer.backends import _p2p

log = logging.getLogger(__name__)

POLL_S = 0.25  # how often the gate looks at its stop flag and its deadlines
ACCEPT_BACKOFF_S = 0.05  # after accept() itself fails (out of descriptors): let some close


@dataclass(slots=True)
class _Pending:
    sock: socket.socket
    deadline: float
    challenge: bytes = b""
    answer: bytearray = field(default_factory=bytearray)


class Gate:
    """Accepts on `listener` until `close()`; see the module docstring."""

    def __init__(self, listener: socket.socket, key: bytes | None,
                 admit: Callable[[socket.socket, _p2p.Session], None], name: str,
                 max_pending: int = _p2p.MAX_PENDING, timeout_s: float = _p2p.CHALLENGE_TIMEOUT_S) -> None:
        self.listener, self.key, self.admit = listener, key, admit
        self.max_pending, self.timeout_s = max_pending, timeout_s
        self.num_refused = 0  # connections closed for want of room, a proof, or time
        self._pending: dict[int, _Pending] = {}
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def close(self, timeout_s: float) -> None:
        """Stop accepting; close every connection still pending (not the listener)."""
        self._stop.set()
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        self.listener.setblocking(False)
        self._selector.register(self.listener, selectors.EVENT_READ, None)
        try:
            while not self._stop.is_set():
                try:
                    self._step()
                except Exception as exc:  # noqa: BLE001 - nothing a peer does may end the accept loop
                    log.warning("transfer listener: %s", exc)
        finally:
            for fd in list(self._pending):
                self._drop(fd)
            self._selector.close()

    def _step(self) -> None:
        now = time.monotonic()
        timeout = min([POLL_S] + [p.deadline - now for p in self._pending.values()])
        for key, _ in self._selector.select(max(0.0, timeout)):
            if key.data is None:
                self._accept()
            else:
                self._advance(key.fd)
        now = time.monotonic()
        for fd in [fd for fd, p in self._pending.items() if p.deadline <= now]:
            self._drop(fd)

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        except OSError as exc:  # out of descriptors or memory: keep the loop, back off a moment
            log.warning("transfer listener: accept failed: %s", exc)
            self._stop.wait(ACCEPT_BACKOFF_S)
            return
        if len(self._pending) >= self.max_pending:
            self.num_refused += 1
            sock.close()
            return
        pending = _Pending(sock, time.monotonic() + self.timeout_s)
        try:
            sock.setblocking(False)
            if self.key is not None:
                pending.challenge = os.urandom(_p2p.PROOF_BYTES)
                if sock.send(pending.challenge) != len(pending.challenge):
                    raise ConnectionError("the challenge did not fit a fresh socket's buffer")
            self._pending[sock.fileno()] = pending
            self._selector.register(sock, selectors.EVENT_READ, pending)
        except OSError:
            self._pending.pop(sock.fileno(), None)
            self.num_refused += 1
            sock.close()

    def _advance(self, fd: int) -> None:
        pending = self._pending[fd]
        try:
            if self.key is None:
                session = _p2p.Session.derive(None, b"", b"", False)
            else:
                session = self._read_answer(pending)
                if session is None:
                    return
        except (OSError, _p2p.PeerNotAuthenticated):
            self._drop(fd)
            return
        self._selector.unregister(pending.sock)
        del self._pending[fd]
        try:
            self.admit(pending.sock, session)
        except Exception as exc:  # noqa: BLE001 - a connection that cannot be served is closed, the gate goes on
            log.warning("transfer listener: could not serve a connection: %s", exc)
            pending.sock.close()

    def _read_answer(self, pending: _Pending) -> _p2p.Session | None:
        """The session once the whole answer is in and proves the key; None while it is not."""
        need = 2 * _p2p.PROOF_BYTES - len(pending.answer)
        data = pending.sock.recv(need)
        if not data:
            raise ConnectionError("closed before answering")
        pending.answer += data
        if len(pending.answer) < 2 * _p2p.PROOF_BYTES:
            return None
        proof, session = _p2p.check_sender(self.key, pending.challenge, bytes(pending.answer))
        pending.sock.setblocking(True)
        _p2p.send_all(pending.sock, proof, pending.deadline)
        return session

    def _drop(self, fd: int) -> None:
        pending = self._pending.pop(fd)
        self.num_refused += 1
        try:
            self._selector.unregister(pending.sock)
        except (KeyError, ValueError):
            pass
        pending.sock.close()

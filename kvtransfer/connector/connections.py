"""A prefill's connections to its receivers, made ahead of the sends: its transports started
when the engine attaches its cache, and the links to a receiver's endpoints opened when its
first hand-off arrives (`connect_ahead`), while the prompt computes. Thread-safe; one thread
of its own. A failure here is only logged: the send connects (and reports) on its own."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from pdserve.kvtransfer.backend_loader import OpenedBackends
from pdserve.kvtransfer.params import TransferParams

log = logging.getLogger("pdserve.kvtransfer.connector")


class Connections:
    def __init__(self, backends: OpenedBackends, step_timeout_s: float) -> None:
        self.backends = backends
        self.step_timeout_s = step_timeout_s
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdkv-connect")
        self._connected: set[tuple[str, str]] = set()  # (backend, endpoint) warmed or warming
        self._closed = False

    def start_transports(self) -> None:
        """Start every opened transport in the background, not on its first send."""
        for name, transport in self.backends.transports.items():
            self._pool.submit(_prepare, name, transport)

    def connect_ahead(self, params: TransferParams) -> None:
        """Warm the links to a receiver's transports in the background, once per endpoint."""
        for backend, endpoint in params.endpoints:
            transport = self.backends.transports.get(backend)
            with self._lock:
                if transport is None or self._closed or (backend, endpoint) in self._connected:
                    continue
                self._connected.add((backend, endpoint))
            self._pool.submit(self._connect, backend, transport, endpoint)

    def _connect(self, backend: str, transport, endpoint: str) -> None:
        start = time.monotonic()
        try:
            transport.connect_ahead(endpoint, start + self.step_timeout_s)
        except Exception as exc:  # noqa: BLE001 - the send will connect (and report) on its own
            with self._lock:
                self._connected.discard((backend, endpoint))
            log.info("kv %s: connecting ahead to %s failed: %s", backend, endpoint, exc)
            return
        log.info("kv %s: connected to %s ahead of its first send (%.1f ms)", backend, endpoint,
                 (time.monotonic() - start) * 1000)

    def close(self) -> None:
        """Take no more; drop what has not started. Idempotent."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)


def _prepare(name: str, transport) -> None:
    try:
        transport.prepare()
    except Exception as exc:  # noqa: BLE001 - the first send will try again (and report)
        log.warning("kv transport %s could not start ahead: %s", name, exc)

"""A room's own threads: work submitted in the background, tracked until done, so the room
can wait for it (flush) and stop taking more (close)."""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable

log = logging.getLogger("pdserve.kvtransfer.connector")


class Background:
    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._inflight: set[Future] = set()
        self.closed = False

    def submit(self, fn: Callable[..., object], *args) -> None:
        future = self._pool.submit(fn, *args)
        with self._lock:
            self._inflight.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: Future) -> None:
        with self._lock:
            self._inflight.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.error("kv connector background task failed: %r", future.exception())

    def flush(self, timeout_s: float) -> bool:
        """Wait for the work submitted so far. False if some still runs at the deadline."""
        with self._lock:
            pending = set(self._inflight)
        _, not_done = wait(pending, timeout=timeout_s)
        return not not_done

    def close(self, timeout_s: float, wait_for_threads: bool = False) -> None:
        """Finish what runs (up to `timeout_s`), drop what has not started. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.flush(timeout_s)
        self._pool.shutdown(wait=wait_for_threads, cancel_futures=True)

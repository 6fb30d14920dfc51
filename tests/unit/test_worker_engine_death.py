"""A worker whose engine thread died stops (so that `up` or Kubernetes restarts it) instead
of staying registered and reporting its last stats for ever."""
from __future__ import annotations

import asyncio
import time

from pdserve.worker import runtime


class Loop:
    """An EngineLoop's `alive` and `error`, as the test sets them."""

    def __init__(self) -> None:
        self.alive = True
        self.error = None


async def test_waiting_ends_when_the_engine_thread_dies(monkeypatch):
    monkeypatch.setattr(runtime, "ENGINE_CHECK_S", 0.01)
    loop = Loop()
    waiting = asyncio.ensure_future(runtime.wait_for_shutdown(loop))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # a live engine: the worker serves on
    loop.alive, loop.error = False, RuntimeError("step failed")
    started = time.monotonic()
    assert await asyncio.wait_for(waiting, 5) is False
    assert time.monotonic() - started < 2

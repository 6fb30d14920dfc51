"""A worker whose engine thread died stops (so that `up` or Kubernetes restarts it) instead
of staying registered and reporting its last stats for ever."""
from __future__ import annotations

import asyncio
import time

from pdserve.worker import runtime


class Loop:
    """An EngineLoop's `alive` and `error`, as the test sets them; counts the checks."""

    def __init__(self) -> None:
        self.running = True
        self.error = None
        self.num_checks = 0

    @property
    def alive(self) -> bool:
        self.num_checks += 1
        return self.running


async def test_waiting_ends_when_the_engine_thread_dies(monkeypatch):
    monkeypatch.setattr(runtime, "ENGINE_CHECK_S", 0.01)
    loop = Loop()
    waiting = asyncio.ensure_future(runtime.wait_for_shutdown(loop))
    deadline = time.monotonic() + 10
    while loop.num_checks < 3:  # checked again and again while the engine lives
        assert time.monotonic() < deadline, "the engine was not checked"
        await asyncio.sleep(0)
    assert not waiting.done()  # a live engine: the worker serves on
    loop.running, loop.error = False, RuntimeError("step failed")
    started = time.monotonic()
    assert await asyncio.wait_for(waiting, 5) is False
    assert time.monotonic() - started < 2

"""The router's bounded pool for templating and tokenizing: work leaves the event loop, and a
full pool refuses (429) instead of queueing without bound."""
from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.common.errors import EXPECTED_ERRORS, ErrorKind
from pdserve.router.cpu_pool import CpuPool


async def test_a_full_pool_refuses_and_the_loop_stays_free():
    pool = CpuPool(max_workers=1, max_pending=2)
    release = threading.Event()
    loop_thread = threading.get_ident()
    ran_on: list[int] = []

    def slow() -> str:
        ran_on.append(threading.get_ident())
        assert release.wait(10)
        return "done"

    first, second = asyncio.create_task(pool.run(slow)), asyncio.create_task(pool.run(slow))
    async with asyncio.timeout(10):
        while pool.num_pending < 2:
            await asyncio.sleep(0.01)  # the loop keeps running while both wait or run
    with pytest.raises(EXPECTED_ERRORS) as caught:
        await pool.run(slow)
    assert caught.value.kind is ErrorKind.RATE_LIMITED and caught.value.retry_after_s == 1
    release.set()
    assert await asyncio.wait_for(asyncio.gather(first, second), 10) == ["done", "done"]
    assert pool.num_pending == 0 and loop_thread not in ran_on
    pool.close()

"""The drain's parts: a worker reporting `draining` is not routed to (its streams stay open),
the router's metrics show it as draining, and `drain` waits for the work in flight within
its deadline."""
from __future__ import annotations

import asyncio

from pdserve.router.config import Role
from pdserve.router.metrics import RouterMetrics
from pdserve.router.worker_registry import Load, Worker, WorkerRegistry
from pdserve.worker.drain import DrainState, OpenCalls, drain


def test_a_draining_worker_is_alive_but_not_routable():
    registry = WorkerRegistry(worker_timeout_s=10)
    for name in ("decode-0", "decode-1"):
        registry.register(Worker(name, Role.DECODE, f"127.0.0.1:{5000 + int(name[-1])}", "m"), Load())
    registry.heartbeat("decode-1", Load(draining=True))
    assert [r.worker_id for r in registry.routable(Role.DECODE, "m")] == ["decode-0"]
    assert [r.worker_id for r in registry.alive(Role.DECODE)] == ["decode-0", "decode-1"]  # streams go on
    text = RouterMetrics(registry).render(registry).decode()
    assert 'pdserve_router_workers{role="decode",state="draining"} 1.0' in text
    assert 'pdserve_router_workers{role="decode",state="alive"} 1.0' in text


def test_drain_announces_then_waits_for_open_calls_and_the_engine():
    async def scenario():
        state, calls, announced = DrainState(), OpenCalls(), []
        busy = [True]
        calls.num_open = 1

        async def announce():
            announced.append(state.draining)
            return True

        async def finish():
            await asyncio.sleep(0.2)
            calls.num_open = 0
            await asyncio.sleep(0.2)
            busy[0] = False

        finishing = asyncio.create_task(finish())
        started = asyncio.get_running_loop().time()
        drained = await drain(state, announce, calls, lambda: busy[0], timeout_s=10)
        await finishing
        return drained, announced, asyncio.get_running_loop().time() - started

    drained, announced, took = asyncio.run(scenario())
    assert drained and announced == [True]  # the report that went out said draining
    assert 0.4 <= took < 5


def test_drain_ends_at_its_deadline_with_work_left():
    async def scenario():
        calls = OpenCalls()
        calls.num_open = 2

        async def announce():
            raise OSError("router gone")

        return await drain(DrainState(), announce, calls, lambda: True, timeout_s=0.3)

    assert asyncio.run(scenario()) is False

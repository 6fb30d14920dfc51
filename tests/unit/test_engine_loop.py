"""EngineLoop: the thread that runs an engine for asyncio services."""
from __future__ import annotations

import asyncio
import threading
import time

from pdserve.engine import engine_loop
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams


def test_a_request_parked_on_a_remote_prefill_does_not_spin_the_engine_thread(tiny_model_factory):
    """While every request waits on something outside the engine, the thread sleeps between
    steps: a spinning one held a core and the GIL through each remote prefill."""
    engine = LLM(str(tiny_model_factory("llama")), num_blocks=32, block_size=16).engine
    stamps: list[float] = []
    enough = threading.Event()  # 21 steps stamped after `first`
    first = None
    step = engine.step

    def counted():
        stamps.append(time.monotonic())
        if first is not None and len(stamps) >= first + 21:
            enough.set()
        return step()

    engine.step = counted

    async def scenario() -> float:
        nonlocal first
        loop = EngineLoop(engine)
        loop.start(asyncio.get_running_loop())
        try:
            stream = await loop.add_request(list(range(3, 40)), SamplingParams(max_tokens=2),
                                            request_id="parked", remote_prefill=True)
            assert await asyncio.wait_for(stream.remote_ready, 10)  # blocks held, waiting
            first = len(stamps)
            assert await asyncio.to_thread(enough.wait, 10), "the engine thread stopped stepping"
            assert await loop.abort("parked")
            return stamps[first + 20] - stamps[first]
        finally:
            loop.stop()

    twenty_steps = asyncio.run(scenario())
    assert twenty_steps >= 20 * engine_loop.PARKED_WAIT_S * 0.9
    engine.assert_no_leaks()


def test_a_remote_prefills_first_token_goes_out_before_the_next_step(tiny_model_factory):
    """The first token a prefill worker chose reaches the request's stream as soon as the
    engine thread takes it, not with the outputs of the step after (which, on a decode busy
    with a prompt of its own, took up to a second)."""
    engine = LLM(str(tiny_model_factory("llama")), num_blocks=32, block_size=16).engine
    handed_over = threading.Event()  # set by the command that hands the first token over
    release = threading.Event()  # the step after the hand-over waits for it
    step = engine.step

    def held():
        if handed_over.is_set():
            release.wait(20)
        return step()

    engine.step = held

    async def scenario():
        loop = EngineLoop(engine)
        loop.start(asyncio.get_running_loop())
        try:
            stream = await loop.add_request(list(range(3, 40)), SamplingParams(max_tokens=2),
                                            request_id="r", remote_prefill=True)
            assert await asyncio.wait_for(stream.remote_ready, 10)

            def hand_over() -> bool:
                done = engine.finish_remote_prefill("r", 5)
                handed_over.set()
                return done

            assert await loop.call(hand_over)
            first = await stream.next(10)  # the step after the hand-over has not run
            release.set()
            rest = await stream.next(10)
            return first, rest
        finally:
            release.set()
            loop.stop()

    first, rest = asyncio.run(scenario())
    assert tuple(first.new_token_ids) == (5,) and not first.finished
    assert len(rest.new_token_ids) == 1 and rest.finished
    engine.assert_no_leaks()


def test_after_the_loop_stops_its_waiters_end_at_once(tiny_model_factory):
    """A stopping decode cancels its cut streams, and each cancellation asks the loop to
    abort its request. Once the thread has stopped those asks, and streams still waiting for
    tokens, end with UnavailableError at once: before, each waited out its own 30 s and
    the process outlived its stop."""
    from pdserve.common.errors import UnavailableError

    engine = LLM(str(tiny_model_factory("llama")), num_blocks=32, block_size=16).engine

    async def scenario() -> None:
        loop = EngineLoop(engine)
        loop.start(asyncio.get_running_loop())
        stream = await loop.add_request(list(range(3, 40)), SamplingParams(max_tokens=2),
                                        request_id="parked", remote_prefill=True)
        assert await asyncio.wait_for(stream.remote_ready, 10)
        loop.stop()
        out = await stream.next(5)  # the stream ends at once, with the reason
        assert isinstance(out, UnavailableError)
        started = time.monotonic()
        try:
            await loop.abort("parked")
        except UnavailableError:
            pass
        else:
            raise AssertionError("an abort after the stop must be refused")
        assert time.monotonic() - started < 1

    asyncio.run(scenario())


def test_a_command_waiting_when_the_thread_stops_is_refused(tiny_model_factory):
    """A command posted while the thread is inside a step, when the stop comes, never runs:
    its caller gets UnavailableError from the stop, not its own timeout."""
    from pdserve.common.errors import UnavailableError

    engine = LLM(str(tiny_model_factory("llama")), num_blocks=32, block_size=16).engine
    inside, release = threading.Event(), threading.Event()

    def stuck_idle() -> None:
        inside.set()
        release.wait(10)

    engine.idle = stuck_idle

    async def scenario() -> None:
        loop = EngineLoop(engine)
        loop.start(asyncio.get_running_loop())
        assert await asyncio.to_thread(inside.wait, 10)
        waiting = asyncio.ensure_future(loop.call(lambda: "ran", timeout=30))
        await asyncio.sleep(0)  # the command is posted
        loop.stop(timeout=0.1)  # the thread is still inside idle(): it cannot take commands
        started = time.monotonic()
        try:
            await asyncio.wait_for(waiting, 5)
        except UnavailableError:
            pass
        else:
            raise AssertionError("a command the thread never ran must be refused")
        assert time.monotonic() - started < 1
        release.set()

    asyncio.run(scenario())

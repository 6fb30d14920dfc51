"""Runs one LLMEngine on its own thread and lets asyncio code use it.

Every engine mutation happens on the engine thread: callers post commands (plain callables)
and await their results; the thread runs commands between steps. Token deltas go back to
per-request asyncio queues through `call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from pdserve.common.errors import UnavailableError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import EngineStats
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import Request

log = logging.getLogger("pdserve.engine.loop")

IDLE_WAIT_S = 0.05  # how long the idle thread sleeps between command checks
# How long a thread whose requests all wait on something outside the engine (a remote
# prefill, a send to finish, blocks to free) sleeps between steps: without it the loop would
# spin a core and hold the GIL through every remote prefill.
PARKED_WAIT_S = 0.002


@dataclass(slots=True)
class RequestStream:
    """What an RPC handler awaits: the request's deltas, then its end."""

    request_id: str
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    remote_ready: asyncio.Future | None = None  # set with the block ids when admitted
    prompt_token_ids: tuple[int, ...] = ()
    block_hashes: tuple[int, ...] = ()  # the engine's keys of the prompt's full blocks

    async def next(self, timeout: float) -> RequestOutput:
        return await asyncio.wait_for(self.outputs.get(), timeout)


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.last_stats: EngineStats = engine.stats()
        self.error: BaseException | None = None
        self._waiting: set[asyncio.Future] = set()  # commands' results, touched on the event loop only

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the thread. A command or a stream still waiting on it then ends with
        `UnavailableError` instead of waiting out its own timeout: a stopping service's
        last cancellations (an abort per cut stream) must not outlive the process's stop."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._refuse_waiting(UnavailableError("the engine has stopped"))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # -- commands -----------------------------------------------------------------------
    async def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run `fn` on the engine thread; its result or exception comes back here.
        `UnavailableError` at once when the thread has stopped or died."""
        if self._stop.is_set() or self.error is not None:
            raise UnavailableError("the engine has stopped")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:  # delivered to the caller, not swallowed
                loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        self._waiting.add(fut)
        self._commands.put(run)
        self._wake.set()
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._waiting.discard(fut)

    async def add_request(self, prompt_token_ids: list[int], params, *, request_id: str,
                          remote_prefill: bool = False,
                          transfer_params: object | None = None, resumed: Sequence[int] = (),
                          cache_salt: str = "", stream_layers: bool = True, blocks=None,
                          lora_name: str | None = None) -> RequestStream:
        stream = RequestStream(request_id)
        if remote_prefill:
            stream.remote_ready = asyncio.get_running_loop().create_future()

        def add() -> Request:
            request = self.engine.add_request(prompt_token_ids, params, request_id=request_id,
                                              remote_prefill=remote_prefill,
                                              transfer_params=transfer_params, resumed=resumed,
                                              cache_salt=cache_salt, stream_layers=stream_layers,
                                              blocks=blocks, lora_name=lora_name)
            self._streams[request_id] = stream
            return request

        request = await self.call(add)
        stream.prompt_token_ids = tuple(request.prompt_token_ids)
        stream.block_hashes = tuple(request.block_hashes)
        return stream

    async def abort(self, request_id: str) -> bool:
        return await self.call(lambda: self.engine.abort(request_id))

    # -- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                # what the commands decided goes out before the next step runs, or a remote
                # prefill's first token would wait a whole step (one with a prompt chunk)
                early = self.engine.take_outputs()
                if early:
                    self._deliver(early, [])
                if self.engine.has_unfinished():
                    outputs, remote_ready = self.engine.step()
                    self._deliver(outputs, remote_ready)
                    if not (self.engine.last_step_ran or outputs or remote_ready):
                        self._wake.wait(PARKED_WAIT_S)  # commands (a remote prefill's end) wake it
                        self._wake.clear()
                else:
                    self.engine.idle()
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                self.last_stats = self.engine.stats()
        except BaseException as exc:  # the service reports unhealthy; requests get errors
            log.exception("engine thread died")
            self.error = exc
            self._refuse_waiting(exc)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            cmd()

    def _deliver(self, outputs: list[RequestOutput], remote_ready: list[Request]) -> None:
        """Hands a step's results to the event loop in one wake-up (one per output made the
        loop thread take the GIL from the engine once per stream per step)."""
        actions: list[tuple[Callable[..., None], Any, Any]] = []
        for request in remote_ready:
            stream = self._streams.get(request.request_id)
            if stream is not None and stream.remote_ready is not None:
                info = (tuple(self.engine.remote_block_ids(request.request_id)),
                        request.num_computed_tokens)  # held already: prefix hit + loads
                actions.append((_set_result, stream.remote_ready, info))
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
                if stream.remote_ready is not None:  # ended before its blocks were ready
                    actions.append((_set_result, stream.remote_ready, None))
            actions.append((_put, stream.outputs, out))
        if actions:
            self._loop.call_soon_threadsafe(_run_all, actions)

    def _refuse_waiting(self, exc: BaseException) -> None:
        """Ends every stream and command still waiting on the thread with `exc` (from any
        thread: the event loop does it)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            loop.call_soon_threadsafe(stream.outputs.put_nowait, exc)
        loop.call_soon_threadsafe(self._fail_commands, exc)

    def _fail_commands(self, exc: BaseException) -> None:
        for fut in list(self._waiting):
            _set_exception(fut, exc)


def _run_all(actions: list[tuple[Callable[..., None], Any, Any]]) -> None:
    for action, target, value in actions:
        action(target, value)


def _put(outputs: asyncio.Queue, value: Any) -> None:
    outputs.put_nowait(value)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)

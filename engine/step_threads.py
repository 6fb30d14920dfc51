"""How many intra-op threads an engine's step takes when engines share one machine's cores.

`up` runs one torch thread per engine, so that a prefill and a decode on two cores do not
thrash; an engine with `burst_threads` takes more while the other engines working for its
requests are idle: a decode while none of its prompts is at a prefill worker, a prefill
while every prompt it holds came from a decode that steps nothing else meanwhile (the
Prefill call's `decode_idle`, which `lends_core`'s answer fills in, and which the decode ends
with DecodeBusy as soon as a request joins it: the prefill's step goes back to its base
count at its next layer, `between_layers`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import itertools
import os
import time
from typing import Any, Callable

import torch

# a decode lends its core to the prefill of its only request after this long with no second
# one: one stream at a time gets its prompts on two cores, clumps of requests do not
LEND_QUIET_S = 2.0


class StepThreads:
    """One engine's thread policy: its base count, its burst count and when to take it,
    whether it lends its core to a prompt's prefill, whether a prompt's KV may stream."""

    def __init__(self, num_threads: int | None, burst_threads: int | None) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.base = self.current = torch.get_num_threads()
        self.burst = burst_threads
        self._crowded_at = -LEND_QUIET_S  # when the engine last held two requests or more
        self._borrowed_from: tuple = ()  # the requests whose senders lent the running step's extra threads

    def added(self, scheduler) -> None:
        """After a request joined `scheduler`."""
        if scheduler.num_unfinished > 1:
            self._crowded_at = time.monotonic()

    def pick(self, scheduler) -> Callable[[], None] | None:
        """Before a step's forward: `burst` threads while no request of `scheduler` waits on
        a remote prefill and every one came from an idle sender, else the base count. The
        switch costs no thread start after the first: the pool keeps them. Returns the hook
        the forward runs before each layer (`between_layers`) when the step takes the burst
        count, else None."""
        if not self.burst:
            return None
        s = scheduler
        held = tuple(itertools.chain(s.running, s.waiting))
        lent = not s.remote and all(r.sender_idle for r in held)
        wanted = self.burst if lent else self.base
        self._borrowed_from = held if wanted != self.base else ()
        self._set(wanted)
        return self.between_layers if self._borrowed_from else None

    def between_layers(self) -> None:
        """Within a step, before each layer: back to the base count once a sender whose core
        the step took has taken other work (its request's `sender_idle` cleared, from another
        thread, by `LLMEngine.sender_busy`). A step on more threads than the machine has free
        cores would stall at every parallel region: 8 prompts at once after a quiet spell found
        the first one's prefill on both cores while the decode prefilled its share beside it
        (2 cores): that prompt's KV arrived 1.7-3.5 s after it was routed, against 0.7-0.9 s
        with the hint ended at the next layer."""
        if self._borrowed_from and not all(r.sender_idle for r in self._borrowed_from):
            self._borrowed_from = ()
            self._set(self.base)

    def _set(self, wanted: int) -> None:
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted

    def streams_layers(self, sender_idle: bool) -> bool:
        """Whether a prompt's KV may go layer by layer while its forward runs. Not when the
        forward takes the idle sender's core too: the sends would then preempt its threads
        (a 200-token prompt on two threads: 450-590 ms streamed, 290-350 ms sent whole
        after the forward), and the sender has nothing to overlap the tail with."""
        return not (sender_idle and self.burst)

    def lends_core(self, scheduler, request_id: str) -> bool:
        """Whether the remote prefill of `request_id` may take this engine's core: it is the
        only request of `scheduler`, and the engine held no two at once for LEND_QUIET_S
        (requests that come in clumps would be stepped here meanwhile, on the lent core, and
        a forward on more threads than cores stalls both). Safe to ask from another thread:
        a hint, whose answer may change at once."""
        s = scheduler
        alone = not s.running and not s.waiting and len(s.remote) == 1 and request_id in s.remote
        return alone and time.monotonic() - self._crowded_at >= LEND_QUIET_S


def one_intra_op_thread() -> None:
    """Run this thread's torch ops on it alone: for the threads beside an engine that move
    blocks (transfer senders and receivers, stores), as a pool's initializer. A large op on
    such a thread (a block gather or scatter) would start an OpenMP team of its own, and once
    a process holds more OpenMP threads than cores, libgomp stops keeping idle ones spinning:
    every parallel region of the engine's steps then waits for a worker to wake (a batch-1
    decode step at two threads went from 10 to 16-22 ms, for the rest of the process's life,
    after receiving whole-prompt messages). Best effort: without a known OpenMP runtime, as before."""
    set_threads = _omp_set_num_threads()
    if set_threads is None:
        return
    torch.get_num_threads()  # torch sizes a thread's OpenMP team on its first use: now, then
    set_threads(1)  # this size sticks (torch does not size it again in this thread)


async def on_passing_thread(fn: Callable[..., Any], *args: Any, name: str = "pdserve-load") -> Any:
    """`fn(*args)` on a thread of its own, which ends as this returns: for work with parallel
    torch ops done off the event loop before an engine steps (loading it). On the loop's
    default executor, whose threads live on, such ops leave an OpenMP team that libgomp
    counts for the rest of the process's life: with more OpenMP threads than cores it stops
    keeping idle workers spinning, and every parallel region of the engine's steps waits for
    one to wake. An engine loaded so ran 20-25% slower at two threads (SmolLM2 from its
    blocks, 200-token prompts + 64 tokens: 91-96 against 114-115 tok/s at batch 8, 24-25
    against 29-31 at batch 1), its threads sleeping ~20,000 times a run at those waits
    against none. A thread that ends takes its team with it."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
    finally:
        pool.shutdown(wait=False)  # its one thread exits now, and the team with it


@functools.cache
def _omp_set_num_threads():
    """`omp_set_num_threads` of the OpenMP runtime torch loaded, or None."""
    for name in ("libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.dylib"):
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).omp_set_num_threads
        except (OSError, AttributeError):
            continue
    return None

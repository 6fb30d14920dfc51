"""Which threads own an OpenMP team: the engine's step thread, and no thread beside it.

torch's CPU ops run on OpenMP. Once a process holds more OpenMP threads than the machine
has cores, libgomp stops keeping idle workers spinning, and every parallel region of the
engine's steps then waits for a worker to wake. So a thread that moves blocks beside the
engine runs its ops on itself alone (`one_intra_op_thread`), and work with parallel ops
done before the engine steps (loading it) runs on a thread that ends, taking its team with
it (`on_passing_thread`). docs/performance.md has what each of these cost before.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import os
from typing import Any, Callable

import torch


def one_intra_op_thread() -> None:
    """Run this thread's torch ops on it alone: for threads beside an engine that move
    blocks (transfer senders and receivers, stores), as a pool's initializer. Best effort:
    without a known OpenMP runtime, nothing changes."""
    set_threads = omp_set_num_threads()
    if set_threads is None:
        return
    torch.get_num_threads()  # torch sizes a thread's OpenMP team on its first use: now, then
    set_threads(1)  # this size sticks (torch does not size it again in this thread)


async def on_passing_thread(fn: Callable[..., Any], *args: Any, name: str = "pdserve-load") -> Any:
    """`fn(*args)` on a thread of its own, which ends as this returns: for work with
    parallel torch ops done off the event loop before an engine steps (loading it). The
    loop's default executor keeps its threads, and with them their OpenMP teams."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
    finally:
        pool.shutdown(wait=False)  # its one thread exits now, and the team with it


@functools.cache
def omp_set_num_threads() -> Callable[[int], None] | None:
    """`omp_set_num_threads` of the OpenMP runtime torch loaded, or None."""
    for name in ("libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.dylib"):
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).omp_set_num_threads
        except (OSError, AttributeError):
            continue
    return None

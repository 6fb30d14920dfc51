"""The threads beside an engine run their torch ops alone (`one_intra_op_thread`), and the
thread that loads it leaves no OpenMP team behind (`on_passing_thread`)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading

import pytest
import torch

from pdserve.kernels.omp import omp_set_num_threads as _omp_set_num_threads, on_passing_thread, one_intra_op_thread
from support import wait_until


def _threads_started_by_a_large_op(initializer) -> int:
    """Threads that started while a fresh thread ran one large parallel op (by id, so that
    other threads of the process ending meanwhile do not count)."""
    out = []

    def run() -> None:
        if initializer is not None:
            initializer()
        before = set(os.listdir("/proc/self/task"))
        torch.ones(4_000_000).mul_(2.0)  # far above torch's grain: parallel when it may be
        out.append(len(set(os.listdir("/proc/self/task")) - before))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=60)
    return out[0]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or _omp_set_num_threads() is None,
                    reason="needs /proc and torch's OpenMP runtime")
def test_a_block_mover_thread_starts_no_openmp_team_of_its_own():
    """A transfer thread's large op would start an OpenMP team (more OpenMP threads than
    cores: libgomp stops keeping the engine's idle workers spinning, and every step waits
    for them to wake); with `one_intra_op_thread` it runs on the thread alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert _threads_started_by_a_large_op(one_intra_op_thread) == 0
        assert _threads_started_by_a_large_op(None) >= 1  # what it prevents (a new team)
    finally:
        torch.set_num_threads(before)


def _large_parallel_op() -> float:
    return float(torch.ones(4_000_000).mul_(2.0)[0])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or _omp_set_num_threads() is None,
                    reason="needs /proc and torch's OpenMP runtime")
def test_loading_on_a_passing_thread_leaves_no_openmp_team_behind():
    """A worker loads its engine off the event loop. On an executor thread, which lives on,
    the load's parallel ops leave that thread's OpenMP team in the process for good (and
    libgomp then lets the engine's own workers sleep at every step's barriers); on the
    passing thread the team is gone with the thread once the result is back."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        async def passing() -> tuple[float, set[str]]:
            start = set(os.listdir("/proc/self/task"))
            value = await on_passing_thread(_large_parallel_op)
            return value, start

        value, start = asyncio.run(passing())
        assert value == 2.0
        # the loading thread and its team's workers exit once the work is done
        wait_until(lambda: not set(os.listdir("/proc/self/task")) - start,
                   "the loading thread and its OpenMP team to exit", timeout=10)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # what it avoids
            start = set(os.listdir("/proc/self/task"))
            assert pool.submit(_large_parallel_op).result(timeout=60) == 2.0
            assert len(set(os.listdir("/proc/self/task")) - start) >= 2  # the thread and its team
    finally:
        torch.set_num_threads(before)


def test_a_passing_threads_exception_reaches_the_caller():
    def fail() -> None:
        raise ValueError("bad model file")

    with pytest.raises(ValueError, match="bad model file"):
        asyncio.run(on_passing_thread(fail))

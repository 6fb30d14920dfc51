"""The threads beside an engine run their torch ops alone (`one_intra_op_thread`)."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from pdserve.engine.step_threads import _omp_set_num_threads, one_intra_op_thread


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

"""`pdserve up`'s supervisor on real child processes: a child that exits is restarted with its
exit status logged, one that keeps failing ends the supervision with a line that says which
and why, a start error is not retried."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from pdserve.deploy import up
from pdserve.deploy.supervisor import GaveUp, RestartPolicy, Supervisor, describe_exit

FAST = RestartPolicy(max_restarts=3, window_s=60.0, backoff_s=0.01, max_backoff_s=0.05)
SERVES = "import time; print('ready on 127.0.0.1:1', flush=True); time.sleep(120)"


def _child(name: str, code: str) -> up.Child:
    return up.Child(name, [sys.executable, "-c", code])


def _supervise_until(supervisor: Supervisor, done, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "supervisor did not get there in time"
        supervisor.check()
        time.sleep(0.02)


def test_a_killed_child_is_restarted_and_the_exit_is_logged():
    said: list[str] = []
    child = _child("decode-0", SERVES)
    up.spawn(child)
    supervisor = Supervisor([child], up.spawn, said.append, FAST)
    try:
        assert child.ready.wait(30)
        first_pid = child.proc.pid
        os.kill(first_pid, signal.SIGKILL)
        _supervise_until(supervisor, lambda: "decode-0 is back" in said)
        assert child.proc.pid != first_pid and child.proc.poll() is None
        assert any("decode-0 exited with signal 9 (SIGKILL); restarting it" in line for line in said), said
        assert supervisor.num_restarts == 1
    finally:
        up.stop([child], grace_s=5)


def test_a_child_that_dies_at_every_start_stops_supervision_after_the_cap():
    said: list[str] = []
    child = _child("prefill-0", "import sys; print('cannot open the model', flush=True); sys.exit(3)")
    up.spawn(child)
    supervisor = Supervisor([child], up.spawn, said.append, FAST)
    with pytest.raises(GaveUp) as failed:
        _supervise_until(supervisor, lambda: False)
    message = str(failed.value)
    assert "prefill-0 exited with status 3" in message and "giving up" in message
    assert "cannot open the model" in message  # its last lines say why
    assert supervisor.num_restarts == FAST.max_restarts
    assert sum("restarting it" in line for line in said) == FAST.max_restarts


def test_a_start_error_is_not_retried():
    said: list[str] = []
    child = _child("decode-0", "import sys; print('pdserve decode: no such model', flush=True); sys.exit(2)")
    up.spawn(child)
    supervisor = Supervisor([child], up.spawn, said.append, FAST)
    with pytest.raises(GaveUp, match="decode-0 could not start") as failed:
        _supervise_until(supervisor, lambda: False)
    assert "no such model" in str(failed.value)
    assert supervisor.num_restarts == 0 and not said


def test_restarts_back_off_and_old_ones_leave_the_window():
    policy = RestartPolicy(max_restarts=2, window_s=60.0, backoff_s=1.0, max_backoff_s=4.0)
    assert [policy.delay_s(n) for n in range(4)] == [1.0, 2.0, 4.0, 4.0]
    now = [0.0]
    child = _child("router", "import sys; sys.exit(1)")
    up.spawn(child)
    child.proc.wait(30)
    said: list[str] = []
    supervisor = Supervisor([child], lambda c: None, said.append, policy, clock=lambda: now[0])
    supervisor.check()  # exit 1: restart due in 1 s
    assert "restarting it in 1 s" in said[-1]
    now[0] = 1.0
    supervisor.check()  # "restarted" (the fake spawn leaves the exited process in place)
    now[0] = 2.0
    supervisor.check()  # second exit within the window: due in 2 s
    assert "restarting it in 2 s" in said[-1]
    now[0] = 70.0  # both restarts have left the window: the next exit is a first again
    supervisor.check()
    supervisor.check()
    assert "restart 1 of at most 2" in said[-1]


def test_describe_exit():
    assert describe_exit(1) == "status 1"
    assert describe_exit(-9) == "signal 9 (SIGKILL)"

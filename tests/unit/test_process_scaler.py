"""`pdserve up`'s process scaler on real (stand-in) processes: workers it starts count as
capacity only once ready and then join the supervisor; a start that fails is reported and not
repeated until asked again; removing a worker drains the youngest (SIGTERM) and forgets it
once it exited."""
from __future__ import annotations

import sys
import time

from pdserve.deploy import up
from pdserve.deploy.scaler import ProcessScaler
from pdserve.deploy.supervisor import Supervisor

READY = "import signal, sys, time; print('pdserve decode ready on 127.0.0.1:1', flush=True); time.sleep(120)"
FAILS = "import sys; print('no such model', flush=True); sys.exit(3)"


def _child(name: str, code: str) -> up.Child:
    return up.Child(name, [sys.executable, "-c", code])


def _until(condition, what: str, timeout_s: float = 30.0, scaler: ProcessScaler | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        if scaler is not None:
            scaler.step()
        time.sleep(0.05)


def test_start_fail_retry_and_drain():
    said: list[str] = []
    first = _child("decode-0", READY)
    up.spawn(first)
    children = [first]
    supervisor = Supervisor(list(children), up.spawn, said.append)
    failing = {"next": True}

    def make(role: str, i: int) -> up.Child:
        code = FAILS if failing["next"] else READY
        return _child(f"{role}-{i}", code)

    scaler = ProcessScaler(children, supervisor, make, up.spawn, said.append, drain_timeout_s=5, grace_s=5)
    try:
        _until(first.ready.is_set, "decode-0 ready")
        assert scaler.roles() == ("decode",) and scaler.counts()["decode"].ready == 1

        scaler.set_target("decode", 2, "test")
        _until(lambda: scaler.counts()["decode"].failed_starts == 1, "a failed start", scaler=scaler)
        count = scaler.counts()["decode"]
        assert count.ready == 1 and count.starting == 0 and "decode-1 exited with status 3" in count.last_failure
        for _ in range(5):
            scaler.step()
        assert scaler.counts()["decode"].starting == 0  # not retried until the planner asks again
        assert [c.name for c in children] == ["decode-0"]

        failing["next"] = False
        scaler.set_target("decode", 2, "retry")
        _until(lambda: scaler.counts()["decode"].ready == 2, "decode-2 ready", scaler=scaler)
        assert [c.name for c in supervisor.children] == ["decode-0", "decode-2"]

        scaler.set_target("decode", 1, "less load")
        scaler.step()
        assert scaler.counts()["decode"].draining == 1 and [c.name for c in supervisor.children] == ["decode-0"]
        _until(lambda: scaler.counts()["decode"].draining == 0, "decode-2 gone", scaler=scaler)
        assert [c.name for c in children] == ["decode-0"] and scaler.counts()["decode"].ready == 1
        assert any("decode-2 drained and exited" in line for line in said), said
        supervisor.check()  # the drained worker is not restarted
        assert [c.name for c in children] == ["decode-0"]
    finally:
        up.stop(children, grace_s=5)

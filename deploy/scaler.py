"""The live planner's `Scaler` under `pdserve up`: worker processes started and drained at run
time, beside the supervisor that keeps the running ones up.

- `set_target` only records the wish (any thread); `step()` acts on it and must be called by
  the launcher's main thread, which forks every child: a child started with PR_SET_PDEATHSIG
  dies with the thread that forked it.
- A new worker (`decode-N`, N never reused) counts as `starting` until it prints its ready
  line, then joins the supervisor (restarted if it crashes, as the first ones are). One that
  exits first, or is not ready within `ready_timeout_s`, is a failed start: reported, counted
  in `failed_starts`, and not started again until the planner asks again (its back-off).
- Removing a worker drains it: the youngest ready one leaves the supervisor and gets SIGTERM,
  upon which it announces that it is draining, finishes its work (`--drain-timeout-s`) and
  exits; SIGKILL only if it is still there `grace_s` after its drain deadline.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from pdserve.deploy.supervisor import Supervisor, describe_exit
from pdserve.planner.scalers import RoleCount


@dataclass(slots=True)
class _Role:
    target: int
    armed: bool = True  # start what is missing; False after a failed start until asked again
    starting: list = field(default_factory=list)  # (child, started at)
    draining: list = field(default_factory=list)  # (child, SIGKILL after)
    failed_starts: int = 0
    last_failure: str = ""


class ProcessScaler:
    def __init__(self, children: list, supervisor: Supervisor, make_child: Callable[[str, int], object],
                 spawn: Callable[[object], None], say: Callable[[str], None], *, drain_timeout_s: float,
                 ready_timeout_s: float = 300.0, grace_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`children`: every process of the deployment (what `up` stops at exit; new ones are
        added, exited ones removed); `make_child(role, n)`: the n-th worker of `role`."""
        self._children, self._supervisor = children, supervisor
        self._make, self._spawn, self._say, self._clock = make_child, spawn, say, clock
        self._drain_s, self._ready_timeout_s, self._grace_s = drain_timeout_s, ready_timeout_s, grace_s
        self._lock = threading.Lock()
        self._roles: dict[str, _Role] = {}
        self._next: dict[str, int] = {}
        for role in ("prefill", "decode"):
            mine = self._serving(role)
            if mine:
                self._roles[role] = _Role(len(mine))
                self._next[role] = 1 + max(int(c.name.rsplit("-", 1)[1]) for c in mine)

    def roles(self) -> tuple[str, ...]:
        return tuple(self._roles)

    def _serving(self, role: str) -> list:
        return [c for c in self._supervisor.children if c.name.startswith(role + "-")]

    def counts(self) -> dict[str, RoleCount]:
        with self._lock:
            out = {}
            for role, r in self._roles.items():
                ready = sum(1 for c in self._serving(role) if c.ready.is_set())
                out[role] = RoleCount(r.target, ready, len(r.starting), len(r.draining), r.failed_starts,
                                      r.last_failure)
            return out

    def set_target(self, role: str, count: int, reason: str) -> None:
        with self._lock:
            r = self._roles[role]
            r.target, r.armed = max(0, count), True
        self._say(f"planner: {role} workers -> {count} ({reason})")

    def step(self) -> None:
        """Act on the targets: adopt what became ready, notice failed starts and finished
        drains, start or drain workers. The launcher's main thread only."""
        with self._lock:
            for role, r in self._roles.items():
                self._watch_starting(role, r)
                self._watch_draining(r)
                active = len(self._serving(role)) + len(r.starting)
                if r.armed and active < r.target:
                    for _ in range(r.target - active):
                        self._start(role, r)
                elif active > r.target:
                    self._drain_one(role, r, active - r.target)

    def _start(self, role: str, r: _Role) -> None:
        child = self._make(role, self._next[role])
        self._next[role] += 1
        self._spawn(child)
        self._children.append(child)
        r.starting.append((child, self._clock()))
        self._say(f"{child.name} starting (pid {child.proc.pid})")

    def _watch_starting(self, role: str, r: _Role) -> None:
        for entry in list(r.starting):
            child, started = entry
            if child.ready.is_set() and child.proc.poll() is None:
                r.starting.remove(entry)
                self._supervisor.adopt(child)
                self._say(f"{child.name} is ready: {role} has {len(self._serving(role))}")
                continue
            returncode = child.proc.poll()
            late = self._clock() - started > self._ready_timeout_s
            if returncode is None and not late:
                continue
            if late and returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, signal.SIGKILL)
                child.proc.wait(5)
            why = (f"not ready within {self._ready_timeout_s:.0f} s" if late
                   else f"exited with {describe_exit(returncode)} before it was ready")
            tail = " | ".join(line for line in child.lines[-3:])
            r.starting.remove(entry)
            self._children.remove(child)
            r.failed_starts += 1
            r.armed = False
            r.last_failure = f"{child.name} {why}"
            self._say(f"{child.name} failed to start: {why}; not counted as capacity. Its last lines: {tail}")

    def _watch_draining(self, r: _Role) -> None:
        for entry in list(r.draining):
            child, kill_at = entry
            returncode = child.proc.poll()
            if returncode is None and self._clock() >= kill_at:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, signal.SIGKILL)
                self._say(f"{child.name} still there {self._grace_s:.0f} s past its drain deadline: killed")
                returncode = child.proc.wait(5)
            if returncode is not None:
                r.draining.remove(entry)
                self._children.remove(child)
                self._say(f"{child.name} drained and exited ({describe_exit(returncode)})")

    def _drain_one(self, role: str, r: _Role, surplus: int) -> None:
        """Stop starting workers first (they serve nothing yet), then drain the youngest ready."""
        while surplus and r.starting:
            child, _ = r.starting.pop()
            self._drain(child, r)
            surplus -= 1
        candidates = [c for c in self._serving(role)
                      if c.ready.is_set() and c.proc.poll() is None and not self._supervisor.restarting(c)]
        for child in sorted(candidates, key=lambda c: int(c.name.rsplit("-", 1)[1]), reverse=True)[:surplus]:
            self._supervisor.release(child)
            self._drain(child, r)

    def _drain(self, child, r: _Role) -> None:
        child.proc.send_signal(signal.SIGTERM)
        r.draining.append((child, self._clock() + self._drain_s + self._grace_s))
        self._say(f"{child.name} draining: no new work; it finishes its own within {self._drain_s:.0f} s")

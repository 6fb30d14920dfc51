"""Keeps `pdserve up`'s processes running, as a process manager would.

A child that exits is started again after a back-off (`RestartPolicy.backoff_s`, doubled for
every restart of that child within the window, at most `max_backoff_s`), and each restart is
logged with the exit status. The others keep serving meanwhile: the router migrates the
streams of a lost decode and routes around a lost prefill. A child that exits more than
`max_restarts` times within `window_s`, or that fails its very first start with a start
error (exit 2: a bad flag or model, which the same start repeats), ends the supervision with
`GaveUp`, which names the child, its last status and its last lines.

Restarts are made by the thread that calls `check` (the launcher's main thread): a child
started with PR_SET_PDEATHSIG dies with the thread that forked it.
"""
from __future__ import annotations

import collections
import signal
import time
from dataclasses import dataclass
from typing import Callable

EXIT_START_ERROR = 2  # a service's one-line start error (bad flag, model, port): not retried


class GaveUp(RuntimeError):
    """A child keeps failing; `up` stops, saying which and why."""


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    max_restarts: int = 5  # per child within window_s; one more exit gives up
    window_s: float = 60.0
    backoff_s: float = 1.0  # before the first restart in the window; doubles per restart
    max_backoff_s: float = 16.0

    def delay_s(self, num_recent: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** num_recent)


def describe_exit(returncode: int) -> str:
    """'status 1', or 'signal 9 (SIGKILL)' for a child a signal ended."""
    if returncode >= 0:
        return f"status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"
    return f"signal {-returncode} ({name})"


class Supervisor:
    """Restarts the children of one deployment. `spawn(child)` starts a child's process (again);
    `say(line)` reports what the supervisor does; `clock` is injectable for tests."""

    def __init__(self, children: list, spawn: Callable[[object], None], say: Callable[[str], None],
                 policy: RestartPolicy = RestartPolicy(), clock: Callable[[], float] = time.monotonic) -> None:
        self.children = children
        self.policy = policy
        self._spawn = spawn
        self._say = say
        self._clock = clock
        self._restarts = {c.name: collections.deque() for c in children}  # recent restart times
        self._due: dict[str, float] = {}  # child name -> when it starts again
        self._returning: set[str] = set()  # restarted, not ready yet
        self._was_ready: set[str] = set()

    def adopt(self, child) -> None:
        """Supervise `child` from now on (a worker the planner added, once ready)."""
        self._restarts.setdefault(child.name, collections.deque())
        self._was_ready.add(child.name)
        self.children.append(child)

    def release(self, child) -> None:
        """Stop supervising `child` (a worker being drained: its exit is wanted, not restarted)."""
        if child in self.children:
            self.children.remove(child)
        self._due.pop(child.name, None)
        self._returning.discard(child.name)

    def restarting(self, child) -> bool:
        """Whether `child` exited and waits for its restart."""
        return child.name in self._due

    @property
    def num_restarts(self) -> int:
        return sum(len(times) for times in self._restarts.values())

    def check(self) -> None:
        """Restart what exited and is due; raise `GaveUp` when a child has failed too often."""
        now = self._clock()
        for child in self.children:
            if child.ready.is_set():
                self._was_ready.add(child.name)
                if child.name in self._returning:
                    self._returning.discard(child.name)
                    self._say(f"{child.name} is back")
            due = self._due.get(child.name)
            if due is not None:
                if now >= due:
                    del self._due[child.name]
                    self._spawn(child)
                    self._returning.add(child.name)
                    self._say(f"{child.name} restarted (pid {child.proc.pid})")
                continue
            returncode = child.proc.poll()
            if returncode is not None:
                self._on_exit(child, returncode, now)

    def _on_exit(self, child, returncode: int, now: float) -> None:
        status = describe_exit(returncode)
        tail = "\n".join(child.lines[-10:])
        if returncode == EXIT_START_ERROR and child.name not in self._was_ready:
            raise GaveUp(f"{child.name} could not start ({status}):\n{tail}")
        recent = self._restarts[child.name]
        while recent and now - recent[0] > self.policy.window_s:
            recent.popleft()
        if len(recent) >= self.policy.max_restarts:
            raise GaveUp(f"{child.name} exited with {status}, its {len(recent) + 1}th exit within "
                         f"{self.policy.window_s:.0f} s; giving up. Its last lines:\n{tail}")
        delay = self.policy.delay_s(len(recent))
        recent.append(now)
        self._due[child.name] = now + delay
        self._returning.discard(child.name)
        child.ready.clear()
        self._say(f"{child.name} exited with {status}; restarting it in {delay:.0f} s "
                  f"(restart {len(recent)} of at most {self.policy.max_restarts} per "
                  f"{self.policy.window_s:.0f} s)")

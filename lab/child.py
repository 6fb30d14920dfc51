"""A command channel to a child process, for benchmarks and tests that need a second process
(a transfer receiver): JSON lines on the child's stdin, JSON-line replies on its stdout
prefixed with REPLY, so whatever a library prints there is ignored. Nothing is pickled.

    child side:   serve_commands(handle)            # handle(cmd: dict) -> dict
    parent side:  Child(argv, log_path).call("init", timeout_s=30, backends=[...])

Every reply is `{"ok": true, ...}` or `{"ok": false, "error": ..., "trace": ...}`; every
wait for one has a deadline.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Callable, Sequence

REPLY = "@@pdserve-child "


def serve_commands(handle: Callable[[dict], dict]) -> None:
    """Child: answer each stdin line until {"cmd": "exit"} or end of input. An exception in
    `handle` becomes an error reply; the parent decides what it means."""
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        try:
            reply = {"ok": True, **handle(cmd)}
        except Exception as exc:  # noqa: BLE001 - the parent gets every failure as a reply
            reply = {"ok": False, "error": f"{exc.__class__.__name__}: {exc}",
                     "trace": traceback.format_exc(limit=3)}
        sys.stdout.write(REPLY + json.dumps(reply) + "\n")
        sys.stdout.flush()


class ChildExited(RuntimeError):
    """The child ended before answering."""


class Child:
    """Parent: starts `argv` (OMP_NUM_THREADS=1 unless set in `env`), stderr to `log_path`
    (or discarded); `timeout_s` is the deadline of a call that names none."""

    def __init__(self, argv: Sequence[str], log_path: Path | None = None,
                 env: dict[str, str] | None = None, timeout_s: float = 60.0) -> None:
        self.log_path = log_path
        self.timeout_s = timeout_s
        self._log = open(log_path, "w") if log_path is not None else subprocess.DEVNULL
        full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env=full_env)
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                self._replies.put(json.loads(line[len(REPLY):]))
        self._replies.put(None)  # end of output: the child is gone

    def call(self, cmd: str, timeout_s: float | None = None, **args) -> dict:
        """The reply, ok or not. TimeoutError past `timeout_s`, ChildExited if it died."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"child gave no answer to {cmd!r} within {timeout_s}s") from None
        if reply is None:
            raise ChildExited(f"child exited before answering {cmd!r}{self._log_tail()}")
        return reply

    def _log_tail(self) -> str:
        if self.log_path is None:
            return ""
        return "; log:\n" + Path(self.log_path).read_text()[-3000:]

    def stop(self, timeout_s: float = 20.0) -> None:
        try:
            self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.log_path is not None:
            self._log.close()

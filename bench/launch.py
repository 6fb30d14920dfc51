"""Start pdserve services as child processes for an experiment, pinned to CPU cores.

Each service is `python -m pdserve.deploy.cli ROLE ...` (any Python program in tests) in
its own session (so stopping
it stops whatever it spawned), with its output in a log file, its CPU affinity set before
exec (shown as the equivalent `taskset -c` command), and torch/OpenMP thread counts set
through the environment as well as `--num-threads`. Stopping is SIGTERM to the process
group, then SIGKILL after a deadline.
"""
from __future__ import annotations

import asyncio
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pdserve.bench.stream import Endpoint, OpenAIStreamClient
from pdserve.bench.workload import BenchRequest, Message

STOP_TIMEOUT_S = 20.0


class LaunchError(RuntimeError):
    """A service exited early or did not become ready in time."""


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """One process to start: `python PROGRAM... ARGS...` (PROGRAM: the pdserve CLI)."""

    name: str
    args: tuple[str, ...]
    cpus: tuple[int, ...] = ()  # empty: not pinned
    num_threads: int | None = None
    program: tuple[str, ...] = ("-m", "pdserve.deploy.cli")

    def argv(self, python: str = sys.executable) -> list[str]:
        return [python, *self.program, *self.args]

    def env(self, base: dict[str, str]) -> dict[str, str]:
        env = dict(base)
        if self.num_threads is not None:
            for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
                env[name] = str(self.num_threads)
        env["TOKENIZERS_PARALLELISM"] = "false"
        return env

    def command_line(self, python: str = sys.executable) -> str:
        """The shell command this spec amounts to (affinity shown as taskset)."""
        prefix = f"taskset -c {','.join(map(str, self.cpus))} " if self.cpus else ""
        threads = f"OMP_NUM_THREADS={self.num_threads} " if self.num_threads is not None else ""
        return threads + prefix + shlex.join(self.argv(python))


class ServiceGroup:
    """Processes started together and stopped together (a context manager)."""

    def __init__(self, specs: Sequence[ServiceSpec], log_dir: Path) -> None:
        self.specs = tuple(specs)
        self.log_dir = log_dir
        self._procs: list[tuple[ServiceSpec, subprocess.Popen, Path]] = []

    def __enter__(self) -> "ServiceGroup":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for spec in self.specs:
            log_path = self.log_dir / f"{spec.name}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    spec.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=spec.env(dict(os.environ)), start_new_session=True,
                    preexec_fn=_affinity_setter(spec.cpus))
            self._procs.append((spec, proc, log_path))

    def check_alive(self) -> None:
        for spec, proc, log_path in self._procs:
            if proc.poll() is not None:
                raise LaunchError(f"{spec.name} exited with code {proc.returncode}; "
                                  f"last lines of {log_path}:\n{_tail(log_path)}")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM every process group (router last), SIGKILL what outlives the deadline."""
        for _, proc, _ in reversed(self._procs):
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for _, proc, _ in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(timeout=timeout_s)
        self._procs.clear()


def _affinity_setter(cpus: tuple[int, ...]):
    if not cpus:
        return None

    def pin() -> None:  # runs in the child between fork and exec
        os.sched_setaffinity(0, cpus)

    return pin


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)  # the child leads its own session: pgid == its pid
    except ProcessLookupError:
        pass


def _tail(path: Path, num_lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"


def wait_ready(group: ServiceGroup, endpoint: Endpoint, timeout_s: float,
               poll_s: float = 0.5) -> str:
    """Block until a one-token request through `endpoint` succeeds; returns the model name.

    Raises LaunchError when a service exits or the deadline passes first."""
    deadline = time.monotonic() + timeout_s
    probe = BenchRequest(-1, "probe", (Message("user", "hello"),), 1, None)
    last_error = "no attempt"
    while time.monotonic() < deadline:
        group.check_alive()
        remaining = max(1.0, deadline - time.monotonic())
        attempt = Endpoint(endpoint.base_url, endpoint.model, endpoint.api_key, endpoint.kind,
                           request_timeout_s=min(30.0, remaining))
        try:
            model, result = asyncio.run(_probe(attempt, probe))
            if result.success:
                return model
            last_error = result.error
        except Exception as e:  # not up yet: connection refused, no models listed...
            last_error = f"{type(e).__name__}: {e}"
        time.sleep(poll_s)
    raise LaunchError(f"services not ready after {timeout_s:g} s (last: {last_error})")


async def _probe(endpoint: Endpoint, probe: BenchRequest):
    async with OpenAIStreamClient(endpoint, max_connections=2) as client:
        model = await client.ensure_model()
        return model, await client.send(probe, time.perf_counter())

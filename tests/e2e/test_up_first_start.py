"""A newcomer's first `pdserve up` (nothing in the build cache): it never goes quiet for more
than the progress interval. The conversion, the wait on the other worker's conversion lock and
model loading each print a line at least every 10 s until the banner."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
from harness import READY_TIMEOUT_S, pick_free_port

from pdserve.common.progress import EVERY_S

pytestmark = pytest.mark.slow


def test_first_start_prints_progress_at_least_every_interval(tmp_path):
    ports = [pick_free_port() for _ in range(3)]
    argv = [sys.executable, "-m", "pdserve.deploy.cli", "up", "--port", str(ports[0]), "--router-grpc-port",
            str(ports[1]), "--router-registry-port", str(ports[2]), "--num-threads", "1"]
    # an empty build cache; the torch attention path keeps the kernel compile (same progress
    # lines, a minute more) out of this test
    env = dict(os.environ, PYTHONUNBUFFERED="1", PDSERVE_CACHE_ROOT=str(tmp_path / "cache"),
               PDSERVE_CPU_ATTENTION="torch")
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[tuple[float, str]] = queue.Queue()
    threading.Thread(target=lambda: [lines.put((time.monotonic(), line)) for line in up.stdout],
                     daemon=True).start()
    seen: list[tuple[float, str]] = []
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not seen or "pdserve is up" not in seen[-1][1]:
            seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
            assert up.poll() is None or not lines.empty(), "".join(line for _, line in seen[-20:])
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(30)
    text = "".join(line for _, line in seen)
    assert "converting SmolLM2-135M-Instruct" in text and "so far" in text  # a long step ticked
    gaps = [(b - a, line) for (a, _), (b, line) in zip(seen, seen[1:])]
    longest = max(gaps)
    print(f"\nfirst start: {len(seen)} lines in {seen[-1][0] - seen[0][0]:.0f} s, longest silence "
          f"{longest[0]:.1f} s before {longest[1].strip()[:100]!r}")
    assert longest[0] <= EVERY_S + 5, longest  # 5 s of slack for a loaded CI machine

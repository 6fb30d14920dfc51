"""`pdserve up` killed outright (SIGKILL: no handler runs) takes its router and workers with
it: nothing is left on its ports within 10 s, so the next `up` starts cleanly."""
from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from harness import READY_TIMEOUT_S, children_of, pick_free_port

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie awaiting its reaper
    except OSError:
        return True


def _free(port: int) -> bool:
    """Whether a new server could listen on `port` now (as servers do, past TIME_WAIT)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_sigkill_of_pdserve_up_leaves_no_process_behind(tmp_path):
    ports = [pick_free_port() for _ in range(3)]
    argv = [sys.executable, "-m", "pdserve.deploy.cli", "up", "--http-port", str(ports[0]),
            "--router-grpc-port", str(ports[1]), "--router-registry-port", str(ports[2]), "--num-threads", "1"]
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=tmp_path)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in launcher.stdout], daemon=True).start()
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if "pdserve is up" in line:
                break
            assert launcher.poll() is None, f"pdserve up exited: {line}"
        children = children_of(launcher.pid)
        assert len(children) == 3, children  # router, prefill-0, decode-0
        assert not any(_free(p) for p in ports)
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in children) or not all(_free(p) for p in ports):
        assert time.monotonic() < deadline, [pid for pid in children if not _gone(pid)]
        time.sleep(0.1)

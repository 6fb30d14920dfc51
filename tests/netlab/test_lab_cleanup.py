"""The lab removes what it made: namespaces (with their links and bridge) and processes,
when its body raises, on SIGTERM, and after a SIGKILL (the next lab sweeps)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.lab.hosts import Lab
from pdserve.lab.namespaces import NETNS_DIR, PREFIX

CHILD = """
import sys, time
from pdserve.lab.hosts import Lab
lab = Lab(["a", "b"]).__enter__()
sleeper = lab.start("sleeper", "b", ["sleep", "600"])
with lab.inside(sys.argv[1]) if len(sys.argv) > 1 else open("/dev/null"):  # a signal mid-request there
    print(sleeper.proc.pid, flush=True)
    time.sleep(600)
"""


def _namespaces(pid: int) -> list[str]:
    return sorted(p.name for p in NETNS_DIR.glob(f"{PREFIX}-{pid}-*")) if NETNS_DIR.is_dir() else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _wait(condition, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_body_that_raises_leaves_no_namespace_and_no_process(lab_allowed):
    with pytest.raises(RuntimeError, match="body failed"):
        with Lab(["a", "b"]) as lab:
            sleeper = lab.start("sleeper", "b", ["sleep", "600"])
            lab.shape("a", 1e9)
            assert len(_namespaces(os.getpid())) == 3  # two hosts and the switch
            raise RuntimeError("body failed")
    assert _namespaces(os.getpid()) == []
    assert sleeper.proc.poll() is not None


def test_bytes_cross_only_a_healed_link(lab_allowed):
    """A cut host is unreachable, a healed one reachable again; its counters see the bytes."""
    import socket

    server = "import socket; s = socket.create_server(('10.77.0.11', 9000)); print('sink ready on b', flush=True); " \
             "c = s.accept()[0]; print(len(c.recv(1 << 16, socket.MSG_WAITALL)), flush=True)"
    with Lab(["a", "b"]) as lab:
        sink = lab.start("sink", "b", [sys.executable, "-c", server])
        lab.wait_ready([sink], 30)
        lab.cut("b")
        with lab.inside("a"), pytest.raises(OSError):
            socket.create_connection((lab["b"].address, 9000), timeout=1)
        lab.heal("b")
        before = lab.counters("b")
        with lab.inside("a"), socket.create_connection((lab["b"].address, 9000), timeout=10) as c:
            c.sendall(b"x" * (1 << 16))
        sink.proc.wait(10)
        assert sink.lines[-1] == str(1 << 16)
        assert (lab.counters("b") - before).rx_bytes >= 1 << 16


@pytest.mark.parametrize("sig, inside", [(signal.SIGTERM, ""), (signal.SIGTERM, "b"), (signal.SIGKILL, "")])
def test_a_killed_lab_is_removed(lab_allowed, sig, inside):
    """SIGTERM: the lab's own handler removes it, also while the signalled thread is inside a
    host. SIGKILL: its services die with it (parent death signal) and the next lab removes its
    namespaces."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, *([inside] if inside else [])],
                             stdout=subprocess.PIPE, text=True)
    try:
        sleeper = int(child.stdout.readline())
        assert len(_namespaces(child.pid)) == 3 and _alive(sleeper)
        child.send_signal(sig)
        assert child.wait(20) == (-sig if sig == signal.SIGKILL else 128 + sig)
        _wait(lambda: not _alive(sleeper), "the service outlived its lab")
        if sig == signal.SIGKILL:
            assert len(_namespaces(child.pid)) == 3  # nobody could clean up yet
            with Lab(["c"]):
                pass
        assert _namespaces(child.pid) == []
    finally:
        if child.poll() is None:
            child.kill()

"""UCX over host transports leaves libc's code alone: with its memory hooks on, starting a
UCX context overwrites the first bytes of libc's mmap family with jumps while the worker's
other threads may be running them (a worker died of SIGSEGV at start in that window). Each
case is a fresh interpreter: UCX reads the setting once, when it is first loaded."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("ucxx", reason="ucxx-cu12 is not installed")

CHILD = """
import ctypes, json, os, sys
libc = ctypes.CDLL("libc.so.6")
NAMES = ("mmap", "munmap", "madvise", "brk", "sbrk", "mremap")
def heads():
    return {n: ctypes.string_at(ctypes.cast(getattr(libc, n), ctypes.c_void_p).value, 8).hex() for n in NAMES}
before = heads()
from pdserve.kvtransfer.backends.ucx import UcxSettings, _Runtime
runtime = _Runtime.acquire(UcxSettings(tls=sys.argv[1]))
patched = sorted(n for n, head in heads().items() if head != before[n])
print(json.dumps({"patched": patched, "events": os.environ.get("UCX_MEM_EVENTS")}), flush=True)
os._exit(0)  # the test is what UCX did at start; shutting it down is tested elsewhere
"""


def start_ucx(tls: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "UCX_MEM_EVENTS"} | env
    out = subprocess.run([sys.executable, "-c", CHILD, tls], capture_output=True, text=True, timeout=120,
                         env=environ)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_host_transports_start_without_patching_libc():
    started = start_ucx("tcp,posix,sysv,self")
    assert started == {"patched": [], "events": "no"}


def test_an_explicit_setting_wins():
    # the same start with the hooks asked for: they patch libc (so the check above can see it)
    started = start_ucx("tcp,posix,sysv,self", UCX_MEM_EVENTS="yes")
    assert started["events"] == "yes" and "mmap" in started["patched"]


def test_transports_that_register_memory_keep_the_hooks():
    from pdserve.kvtransfer.backends.ucx import keep_libc_unpatched

    saved = os.environ.pop("UCX_MEM_EVENTS", None)
    try:
        assert not keep_libc_unpatched("tcp,self,cuda_copy,cuda_ipc")
        assert not keep_libc_unpatched("rc,tcp,self")
        assert "UCX_MEM_EVENTS" not in os.environ
    finally:
        if saved is not None:
            os.environ["UCX_MEM_EVENTS"] = saved

"""`pdserve up`'s process lifecycle with real processes: children die with their launcher, and
no gRPC listener shares its port."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from pdserve.rpc.server import SERVER_OPTIONS

LAUNCHER = """
import subprocess, sys, time
from pdserve.deploy.up import _die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=_die_with_parent)
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie awaiting its reaper counts as gone
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_sigkill_of_the_launcher_leaves_no_child_behind():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    child_pid = int(launcher.stdout.readline())
    assert _alive(child_pid)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(10)
    deadline = time.monotonic() + 10
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child_pid)


def test_a_second_server_on_a_used_port_fails_to_bind():
    async def scenario() -> None:
        first = grpc.aio.server(options=SERVER_OPTIONS)
        port = first.add_insecure_port("127.0.0.1:0")
        await first.start()
        try:
            second = grpc.aio.server(options=SERVER_OPTIONS)
            with pytest.raises(RuntimeError):
                second.add_insecure_port(f"127.0.0.1:{port}")
        finally:
            await first.stop(None)

    asyncio.run(scenario())


def test_a_port_conflict_names_the_port_and_who_wanted_it():
    """The router's HTTP, client gRPC and registry ports, and a worker's gRPC port: taken by
    another process, each start fails with the address and the role, not a bare errno."""

    from pdserve.router.app import RouterApp
    from pdserve.router.config import RouterConfig
    from pdserve.worker.runtime import bind_server
    from pdserve.worker.settings import WorkerSettings

    async def scenario() -> None:
        holder = grpc.aio.server(options=SERVER_OPTIONS)
        taken = holder.add_insecure_port("127.0.0.1:0")
        await holder.start()
        try:
            for field, what in (("http_port", "HTTP"), ("grpc_port", "the client API"),
                                ("registry_port", "the worker registry")):
                ports = {"http_port": 0, "grpc_port": 0, "registry_port": 0, field: taken}
                app = RouterApp(RouterConfig(host="127.0.0.1", log_level="WARNING", **ports))
                with pytest.raises(OSError) as caught:
                    await app.start()
                await app.stop(0)
                assert f"router: cannot listen for {what}" in str(caught.value), str(caught.value)
                assert f"127.0.0.1:{taken}" in str(caught.value)
            with pytest.raises(OSError, match=f"decode: cannot listen for gRPC on 127.0.0.1:{taken}"):
                bind_server(WorkerSettings.from_settings("decode", {"grpc_port": taken}))
        finally:
            await holder.stop(None)

    asyncio.run(scenario())

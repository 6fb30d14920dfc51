"""The lab's namespaces on this machine: naming, `ip`, whether a lab can be built here, and
removal of a lab's namespaces (also of a lab whose process was SIGKILLed).

A namespace is `pdlab-<pid>-<seq>-<name>`: the pid says whose it is, so the next lab on the
machine removes those of a process that is gone. Removing a namespace kills every process
left in it; its veth ends and bridge go with it.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import contextlib
from pathlib import Path

NETNS_DIR = Path("/run/netns")
PREFIX = "pdlab"
NAME = re.compile(rf"^{PREFIX}-(\d+)-\d+-[a-z0-9-]+$")
_SEQ = itertools.count()


class LabError(RuntimeError):
    """An `ip`/`tc` command failed, or a service died or did not become ready."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise LabError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc



def new_tag() -> str:
    """A prefix no other lab of this machine uses: `pdlab-<pid>-<seq>`."""
    return f"{PREFIX}-{os.getpid()}-{next(_SEQ)}"


def unavailable() -> str | None:
    """Why a lab cannot be built here (None: it can): not root, no iproute2, or namespaces
    refused (a container without CAP_SYS_ADMIN, a kernel without them)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "the network lab needs root (ip netns add)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the network lab needs iproute2 ('{tool}' is not on PATH)"
    probe = f"{new_tag()}-probe"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"'ip netns add' is not allowed here: {made.stderr.strip()}"
    try:  # links too (a namespace alone needs CAP_SYS_ADMIN, links CAP_NET_ADMIN)
        link = ip("-n", probe, "link", "add", "name", "probe0", "type", "veth", "peer", "name", "probe1",
                   check=False)
        if link.returncode != 0:
            return f"'ip link add ... type veth' is not allowed here: {link.stderr.strip()}"
    finally:
        ip("netns", "del", probe, check=False)
    return None



def remove_netns(netns: str) -> None:
    """Kill every process still in `netns` (all started by a lab), then delete it; its veth
    ends and bridge go with it."""
    pids = {int(pid) for pid in ip("netns", "pids", netns, check=False).stdout.split()}
    pids.discard(os.getpid())  # a thread of ours may be `inside` it (a signal came mid-request)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    ip("netns", "del", netns, check=False)


def sweep_orphans() -> None:
    """Namespaces of labs whose process is gone (SIGKILLed before it could clean up)."""
    if not NETNS_DIR.is_dir():
        return
    for entry in NETNS_DIR.iterdir():
        match = NAME.match(entry.name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            remove_netns(entry.name)
        except PermissionError:
            pass  # alive, someone else's


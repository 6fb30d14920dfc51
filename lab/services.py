"""Services in the lab: one process started inside a host (its output kept and watched for
its ready line), and a deployment of the role commands across hosts, started as processes
through the `pdserve` CLI (the lab never imports `pdserve.deploy`)."""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from pdserve.lab.namespaces import LabError
from pdserve.router.config import ROUTER_HTTP_PORT, ROUTER_REGISTRY_PORT

if TYPE_CHECKING:
    from pdserve.lab.hosts import Host, Lab

STOP_GRACE_S = 10.0  # every pdserve process stops within 10 s of SIGTERM (DESIGN §8)
_USABLE = re.compile(r'^pdserve_router_kv_backend_usable\{([^}]*)\} (\S+)$', re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_GAUGE = re.compile(r'^pdserve:(kv_cache_usage_perc|num_requests_running)\{[^}]*worker_id="([^"]+)"[^}]*\} (\S+)$',
                    re.MULTILINE)


@dataclass
class Service:
    """One process started inside a host; its output kept (last 400 lines) and watched for
    its ready line."""

    name: str
    host: Host
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)

    def pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            del self.lines[:-400]
            if " ready on " in line or "router ready" in line or "Uvicorn running" in line:
                self.ready.set()

    def tail(self, num_lines: int = 30) -> str:
        return "\n".join(self.lines[-num_lines:])

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM its process group, SIGKILL once `grace_s` has passed. (What it leaves
        behind in its host dies with the host: `Lab.close`.)"""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # not reaped yet: the group is still its own
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def die_with_lab() -> None:
    """In the child before exec: its own session, and SIGKILL when the lab's thread dies."""
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG

@dataclass
class Deployment:
    """A router and its workers, each in a host of its own, started with the role commands."""

    lab: Lab
    router: Service
    workers: list[Service]
    admin_key: str = ""  # the router's admin key: a keyless router off loopback shows no internals

    @property
    def url(self) -> str:
        return f"http://{self.router.host.address}:{ROUTER_HTTP_PORT}"

    def request(self, path: str, body: dict | None = None, timeout_s: float = 120.0) -> dict:
        """`path` of the router's HTTP API, asked from the router's own host; its JSON."""
        return json.loads(self.lab.http(self.router.host.name, self.url + path, body, timeout_s,
                                        headers=self.admin_headers()) or b"{}")

    def admin_headers(self) -> dict[str, str]:
        """What a request sends to see the router's internals (routing, transfer verdicts)."""
        return {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}

    def gauges(self) -> dict[str, tuple[float, float]]:
        """worker id -> (share of its KV cache in use, requests running), from the router's
        /metrics (the workers' last heartbeats)."""
        text = self.lab.http(self.router.host.name, self.url + "/metrics", timeout_s=10).decode()
        seen: dict[str, list[float]] = {}
        for metric, worker, value in _GAUGE.findall(text):
            seen.setdefault(worker, [0.0, 0.0])[metric == "num_requests_running"] = float(value)
        return {worker: (usage, running) for worker, (usage, running) in seen.items()}

    def backends_usable(self) -> dict[tuple[str, str], bool]:
        """(worker id, KV backend) -> whether the worker's last heartbeat reported it usable,
        from the router's /metrics."""
        text = self.lab.http(self.router.host.name, self.url + "/metrics", timeout_s=10).decode()
        found = {}
        for labels, value in _USABLE.findall(text):
            named = dict(_LABEL.findall(labels))
            found[named.get("worker_id", ""), named.get("backend", "")] = float(value) == 1.0
        return found

    def wait_idle(self, timeout_s: float = 30.0, settle_s: float = 2.5) -> None:
        """Until every worker has reported its whole KV pool free and nothing running for
        `settle_s` (longer than a heartbeat, so no report from before the last request
        passes): the leak check."""
        deadline = time.monotonic() + timeout_s
        idle_since = None
        while True:
            gauges = self.gauges()
            now = time.monotonic()
            if all(gauges.get(w.name) == (0.0, 0.0) for w in self.workers):
                idle_since = idle_since or now
                if now - idle_since >= settle_s:
                    return
            else:
                idle_since = None
            if now > deadline:
                raise LabError(f"not idle after {timeout_s:.0f} s (cache share in use, running): {gauges}")
            time.sleep(0.25)

    def stop(self) -> None:
        for service in [*self.workers, self.router]:
            service.stop()


def _admin_key(router_args: Sequence[str]) -> tuple[str, list[str]]:
    """(an admin key, the router's flag naming its private file) unless `router_args` bring
    their own: the lab's router listens off loopback, where only the admin sees internals."""
    if "--admin-api-key-file" in router_args:
        return "", []
    key = secrets.token_urlsafe(24)
    path = os.path.join(tempfile.mkdtemp(prefix="pdserve-lab-admin-"), "admin-key")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(key + "\n")
    return key, ["--admin-api-key-file", path]


def deploy(lab: Lab, secret_file: str, router: str, prefill: Sequence[str], decode: Sequence[str],
           router_args: Sequence[str] = (), worker_args: Sequence[str] = (),
           worker_env: dict[str, str] | None = None, timeout_s: float = 240.0,
           per_host_args: dict[str, Sequence[str]] | None = None) -> Deployment:
    """`pdserve router` on host `router`, one `pdserve prefill` per host in `prefill`, one
    `pdserve decode` per host in `decode`, each bound to its host's address on the default
    ports (hosts do not share ports), UCX over TCP only (no shared memory between hosts).
    `per_host_args[name]` are added to the command of the worker on host `name` (its own
    TLS certificate). Returns once every worker is ready and registered."""
    py = [sys.executable, "-m", "pdserve.deploy.cli"]
    secret = ["--cluster-secret-file", secret_file]
    r = lab[router]
    admin_key, admin = _admin_key(router_args)
    router_service = lab.start("router", router, [*py, "router", "--host", r.address, *secret, *admin,
                                                  *router_args])
    env = {"PDSERVE_UCX_TLS": "tcp,self", **(worker_env or {})}
    workers = []
    for role, hosts in (("prefill", prefill), ("decode", decode)):
        for name in hosts:
            argv = [*py, role, "--host", lab[name].address, "--router", f"{r.address}:{ROUTER_REGISTRY_PORT}",
                    "--worker-id", name, *secret, *worker_args, *(per_host_args or {}).get(name, ())]
            workers.append(lab.start(name, name, argv, env))
    deployment = Deployment(lab, router_service, workers, admin_key)
    deadline = time.monotonic() + timeout_s
    lab.wait_ready([router_service, *workers], timeout_s)
    while True:
        with contextlib.suppress(OSError, ValueError):
            health = deployment.request("/health", timeout_s=5)
            if health.get("decode_workers", 0) + health.get("prefill_workers", 0) >= len(workers):
                return deployment
        if time.monotonic() > deadline:
            raise LabError(f"the router did not register {len(workers)} workers in {timeout_s:.0f} s:\n"
                           + router_service.tail())
        time.sleep(0.2)


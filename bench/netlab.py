"""A network lab: N hosts as Linux network namespaces on one switch, for services that must
not share a machine's loopback.

Each host is a namespace `pdlab-<pid>-<seq>-<name>` with `lo` up and one interface `eth0`
(address `<subnet>.<10 + i>/24`), the host end of a veth pair whose other end is port `p<i>`
of bridge `br0` in a switch namespace of the lab's own. Nothing is added to the root
namespace: no route leads out, so every packet a service sends stays inside the lab.

- Services are the real role commands, started inside their host with `ip netns exec`.
- `shape(host, rate)`: a `tc tbf` rate on both directions of the host's link (the host's
  egress on `eth0`, its ingress as the switch port's egress). Delay is NOT emulated: `netem`
  is missing on these kernels, and tbf's `latency` only bounds its queue.
- `cut(host)` / `heal(host)`: the switch port down / up. The host keeps its address and
  routes and sees only a lost carrier, as with a pulled cable, so peers find out by timeouts.
- `counters(host)`: `eth0`'s byte counters, read from sysfs inside the host: proof that bytes
  crossed the link.
- `inside(host)`: the calling thread's network namespace switched to the host's, so a client
  socket opened there (urllib, httpx) talks from that host.

A lab removes everything it made (processes, namespaces and with them their links and the
bridge) on leaving its `with`, at interpreter exit, on SIGTERM/SIGHUP, and, for a lab whose
process was SIGKILLed, when the next lab on the machine starts. It needs root and iproute2;
`unavailable()` says why not, for tests to skip with.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import dataclasses
import importlib.util
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from pdserve.router.config import ROUTER_HTTP_PORT, ROUTER_REGISTRY_PORT

NETNS_DIR = Path("/run/netns")
PREFIX = "pdlab"
CLONE_NEWNET = 0x40000000
STOP_GRACE_S = 10.0  # every pdserve process stops within 10 s of SIGTERM (DESIGN §8)
_NAME = re.compile(rf"^{PREFIX}-(\d+)-\d+-[a-z0-9-]+$")
_SEQ = itertools.count()
_USABLE = re.compile(r'^pdserve_router_kv_backend_usable\{([^}]*)\} (\S+)$', re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_GAUGE = re.compile(r'^pdserve:(kv_cache_usage_perc|num_requests_running)\{[^}]*worker_id="([^"]+)"[^}]*\} (\S+)$',
                    re.MULTILINE)


class LabError(RuntimeError):
    """An `ip`/`tc` command failed, or a service died or did not become ready."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise LabError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


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
    probe = f"{PREFIX}-{os.getpid()}-{next(_SEQ)}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"'ip netns add' is not allowed here: {made.stderr.strip()}"
    try:  # links too (a namespace alone needs CAP_SYS_ADMIN, links CAP_NET_ADMIN)
        link = _ip("-n", probe, "link", "add", "name", "probe0", "type", "veth", "peer", "name", "probe1",
                   check=False)
        if link.returncode != 0:
            return f"'ip link add ... type veth' is not allowed here: {link.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True, slots=True)
class Host:
    name: str
    netns: str
    address: str
    port: str  # its link's port on the switch
    dev: str = "eth0"

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host."""
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass(frozen=True, slots=True)
class Counters:
    rx_bytes: int
    tx_bytes: int

    def __sub__(self, other: "Counters") -> "Counters":
        return Counters(self.rx_bytes - other.rx_bytes, self.tx_bytes - other.tx_bytes)


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


def _die_with_lab() -> None:
    """In the child before exec: its own session, and SIGKILL when the lab's thread dies."""
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


class Lab:
    """Hosts `names` on one switch, addresses `subnet`.10, .11, ... in that order."""

    def __init__(self, names: Sequence[str], subnet: str = "10.77.0") -> None:
        if len(set(names)) != len(names) or not all(re.fullmatch(r"[a-z][a-z0-9-]{0,15}", n) for n in names):
            raise ValueError(f"host names must be distinct, lowercase, at most 16 characters: {names}")
        tag = f"{PREFIX}-{os.getpid()}-{next(_SEQ)}"
        self.switch = f"{tag}-switch"
        self.hosts = {n: Host(n, f"{tag}-{n}", f"{subnet}.{10 + i}", f"p{i}") for i, n in enumerate(names)}
        self.services: list[Service] = []
        self._made: list[str] = []  # namespaces, in creation order
        self._lock = threading.RLock()  # a signal may close the lab while its thread holds it
        self.closed = False

    def __enter__(self) -> "Lab":
        _REAPER.adopt(self)
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def build(self) -> None:
        _sweep_orphans()
        self._add_netns(self.switch)
        _ip("-n", self.switch, "link", "add", "name", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts.values():
            self._add_netns(host.netns)
            _ip("link", "add", "name", host.dev, "netns", host.netns, "type", "veth", "peer", "name", host.port,
                "netns", self.switch)
            _ip("-n", self.switch, "link", "set", host.port, "master", "br0", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.dev)
            _ip("-n", host.netns, "link", "set", host.dev, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    # -- the links ---------------------------------------------------------------------------

    def shape(self, name: str, rate_bit_s: float | None) -> None:
        """The link of host `name` limited to `rate_bit_s` each way (None: unshaped). Burst: the
        larger of 1 ms at the rate and 64 KiB plus a frame (a GSO segment must fit); queue: 50 ms."""
        host = self.hosts[name]
        for netns, dev in ((host.netns, host.dev), (self.switch, host.port)):
            subprocess.run(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if rate_bit_s is None:
                continue
            rate = int(rate_bit_s)
            burst = max(rate // 8 // 1000, 65536 + 1514)
            proc = subprocess.run(["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                                   f"{rate}bit", "burst", str(burst), "latency", "50ms"],
                                  capture_output=True, text=True, timeout=30)
            if proc.returncode != 0:
                raise LabError(f"tc tbf on {name}: {proc.stderr.strip()}")

    def cut(self, name: str) -> None:
        """Host `name`'s cable pulled at the switch: nothing crosses until `heal`."""
        _ip("-n", self.switch, "link", "set", self.hosts[name].port, "down")

    def heal(self, name: str) -> None:
        _ip("-n", self.switch, "link", "set", self.hosts[name].port, "up")

    def counters(self, name: str) -> Counters:
        """Bytes host `name`'s interface has received and sent so far."""
        host = self.hosts[name]
        stats = f"/sys/class/net/{host.dev}/statistics"
        proc = subprocess.run(host.argv(["cat", f"{stats}/rx_bytes", f"{stats}/tx_bytes"]),
                              capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise LabError(f"counters of {name}: {proc.stderr.strip()}")
        rx, tx = proc.stdout.split()
        return Counters(int(rx), int(tx))

    @contextlib.contextmanager
    def inside(self, name: str) -> Iterator[None]:
        """The calling thread in host `name`'s network namespace (sockets opened meanwhile
        stay there); back in its own afterwards."""
        libc = ctypes.CDLL(None, use_errno=True)
        with open("/proc/thread-self/ns/net") as home, open(NETNS_DIR / self.hosts[name].netns) as there:
            if libc.setns(there.fileno(), CLONE_NEWNET) != 0:
                raise LabError(f"setns into {name}: {os.strerror(ctypes.get_errno())}")
            try:
                yield
            finally:
                if libc.setns(home.fileno(), CLONE_NEWNET) != 0:  # a thread left behind would lie
                    raise LabError(f"setns back from {name}: {os.strerror(ctypes.get_errno())}")

    # -- services ----------------------------------------------------------------------------

    def start(self, name: str, host: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Service:
        """`argv` started inside `host`, in a session of its own, killed if this thread dies."""
        h = self.hosts[host]
        proc = subprocess.Popen(h.argv(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, preexec_fn=_die_with_lab,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
        service = Service(name, h, proc)
        with self._lock:
            self.services.append(service)
        threading.Thread(target=service.pump, daemon=True, name=f"netlab-{name}").start()
        return service

    def wait_ready(self, services: Sequence[Service], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for service in services:
            while not service.ready.wait(0.2):
                if service.proc.poll() is not None:
                    raise LabError(f"{service.name} exited with {service.proc.returncode}:\n{service.tail()}")
                if time.monotonic() > deadline:
                    raise LabError(f"{service.name} not ready after {timeout_s:.0f} s:\n{service.tail()}")

    def http(self, host: str, url: str, body: dict | None = None, timeout_s: float = 120.0) -> bytes:
        """One HTTP request (POST with a JSON `body`, else GET) from inside `host`; its body."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        with self.inside(host), urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.read()

    # -- teardown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every service, kill what is left in the lab's namespaces, delete them."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            services, self.services = self.services, []
        for service in reversed(services):
            service.stop()
        for netns in reversed(self._made):
            _remove_netns(netns)
        self._made.clear()
        _REAPER.release(self)


@dataclass
class Deployment:
    """A router and its workers, each in a host of its own, started with the role commands."""

    lab: Lab
    router: Service
    workers: list[Service]

    @property
    def url(self) -> str:
        return f"http://{self.router.host.address}:{ROUTER_HTTP_PORT}"

    def request(self, path: str, body: dict | None = None, timeout_s: float = 120.0) -> dict:
        """`path` of the router's HTTP API, asked from the router's own host; its JSON."""
        return json.loads(self.lab.http(self.router.host.name, self.url + path, body, timeout_s) or b"{}")

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
    router_service = lab.start("router", router, [*py, "router", "--host", r.address, *secret, *router_args])
    env = {"PDSERVE_UCX_TLS": "tcp,self", **(worker_env or {})}
    workers = []
    for role, hosts in (("prefill", prefill), ("decode", decode)):
        for name in hosts:
            argv = [*py, role, "--host", lab[name].address, "--router", f"{r.address}:{ROUTER_REGISTRY_PORT}",
                    "--worker-id", name, *secret, *worker_args, *(per_host_args or {}).get(name, ())]
            workers.append(lab.start(name, name, argv, env))
    deployment = Deployment(lab, router_service, workers)
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


def _remove_netns(netns: str) -> None:
    """Kill every process still in `netns` (all started by a lab), then delete it; its veth
    ends and bridge go with it."""
    pids = {int(pid) for pid in _ip("netns", "pids", netns, check=False).stdout.split()}
    pids.discard(os.getpid())  # a thread of ours may be `inside` it (a signal came mid-request)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _ip("netns", "del", netns, check=False)


def _sweep_orphans() -> None:
    """Namespaces of labs whose process is gone (SIGKILLed before it could clean up)."""
    if not NETNS_DIR.is_dir():
        return
    for entry in NETNS_DIR.iterdir():
        match = _NAME.match(entry.name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            _remove_netns(entry.name)
        except PermissionError:
            pass  # alive, someone else's


class _Reaper:
    """The open labs of this process, closed at exit and on SIGTERM/SIGHUP (then the signal
    goes on to whatever handled it before; the handlers are installed when the first lab
    opens on the main thread)."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.labs: list[Lab] = []
        self.previous: dict[int, object] = {}
        self.installed = False

    def adopt(self, lab: Lab) -> None:
        self.labs.append(lab)
        if not self.installed:
            self.installed = True
            atexit.register(self.close_all)
            if threading.current_thread() is threading.main_thread():
                for sig in self.SIGNALS:
                    self.previous[sig] = signal.signal(sig, self.on_signal)

    def release(self, lab: Lab) -> None:
        with contextlib.suppress(ValueError):
            self.labs.remove(lab)

    def close_all(self) -> None:
        for lab in list(reversed(self.labs)):
            lab.close()

    def on_signal(self, sig: int, frame) -> None:
        self.close_all()
        previous = self.previous.get(sig, signal.SIG_DFL)
        if callable(previous):
            previous(sig, frame)
        elif previous != signal.SIG_IGN:  # the default ends the process: as an exit, finally blocks run
            raise SystemExit(128 + sig)


_REAPER = _Reaper()


# -- `pdserve bench network`: TTFT across hosts at shaped rates ---------------------------------

MODES = {  # router flags of each way to serve a long prompt
    "disaggregated": ("--local-prefill-threshold", "0", "--static-routing"),
    "local": ("--local-prefill-threshold", "1000000000"),  # the decode's own prefill
    "router": (),  # the router's own choice, from its TTFT prediction
}


@dataclass(frozen=True, slots=True)
class Sample:
    mode: str
    rate: str
    ttft_s: float
    transfer_bytes: int
    transfer_ms: float
    decode_rx_bytes: int
    prefill_worker_id: str  # empty: the decode prefilled locally
    prefill_reason: str


def parse_rate(text: str) -> float | None:
    """'0.2' (Gbit/s) -> bits/s; 'unshaped' -> None."""
    return None if text.strip() == "unshaped" else float(text) * 1e9


def stream_ttft(cluster: Deployment, body: dict, timeout_s: float = 300.0) -> tuple[float, dict]:
    """Seconds from sending a streamed completion to its first token's chunk, and the
    request's `pdserve` extras merged over its chunks."""
    req = urllib.request.Request(cluster.url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    extras: dict = {}
    first = None
    started = time.perf_counter()
    with cluster.lab.inside(cluster.router.host.name), urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter() - started
            for key, value in (chunk.get("pdserve") or {}).items():
                extras.setdefault(key, value)
    if first is None:
        raise LabError(f"no token came back: {extras}")
    return first, extras


def long_prompts(num_tokens: int, count: int) -> list[str]:
    """`count` prompts of about `num_tokens` tokens that share no prefix block (each starts
    with its own number), so no prefix cache serves one from another."""
    from pdserve.engine.loader import load_model

    tok = load_model("default").tokenizer
    words = "the quick brown fox jumps over a lazy dog near seven quiet rivers and tall green hills".split()
    body = " ".join(f"{words[i % len(words)]}{i % 97}" for i in range(num_tokens))
    body = tok.decode(tok(body).input_ids[: num_tokens - 24])
    return [f"Request {i} of run {os.getpid()}-{time.time_ns()}: {body} Summarize." for i in range(count)]


def measure(mode: str, rates: Sequence[str], prompts: Iterator[str], repeats: int, worker_args: Sequence[str],
            secret_file: str, max_tokens: int) -> list[Sample]:
    """One deployment serving in `mode`; `repeats` prompts at each link rate."""
    samples = []
    with Lab(["router", "prefill", "decode"]) as lab:
        cluster = deploy(lab, secret_file, "router", ["prefill"], ["decode"], MODES[mode], worker_args)
        model = cluster.request("/v1/models")["data"][0]["id"]
        stream_ttft(cluster, {"model": model, "prompt": "Warm up.", "max_tokens": 1, "temperature": 0})
        for rate in rates:
            for host in lab.hosts:
                lab.shape(host, parse_rate(rate))
            for _ in range(repeats):
                before = lab.counters("decode")
                ttft, extras = stream_ttft(cluster, {"model": model, "prompt": next(prompts),
                                                     "max_tokens": max_tokens, "temperature": 0})
                crossed = lab.counters("decode") - before
                transfer, routing = extras.get("transfer") or {}, extras.get("routing") or {}
                samples.append(Sample(mode, rate, ttft, int(transfer.get("bytes", 0)),
                                      float(transfer.get("duration_ms", 0.0)), crossed.rx_bytes,
                                      routing.get("prefill_worker_id", ""), routing.get("prefill_reason", "")))
                print(f"  {samples[-1]}", flush=True)
        cluster.wait_idle()
        cluster.stop()
    return samples


def table(samples: Sequence[Sample], rates: Sequence[str]) -> str:
    """Median TTFT per rate and mode, the KV bytes that crossed, and where disaggregation pays."""
    def median_of(mode: str, rate: str, attr: str = "ttft_s") -> float | None:
        values = [getattr(s, attr) for s in samples if s.mode == mode and s.rate == rate]
        return statistics.median(values) if values else None

    lines = [f"{'rate Gbit/s':>12} {'disagg TTFT s':>14} {'local TTFT s':>13} {'KV MB':>7} {'decode rx MB':>13} "
             f"{'transfer ms':>12}  router's choice"]
    pays = []
    for rate in rates:
        d, loc = median_of("disaggregated", rate), median_of("local", rate)
        kv, rx, ms = (median_of("disaggregated", rate, a) for a in ("transfer_bytes", "decode_rx_bytes", "transfer_ms"))
        choice = sorted({f"{'prefill host' if s.prefill_worker_id else 'local'} ({s.prefill_reason})"
                         for s in samples if s.mode == "router" and s.rate == rate})
        cell = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        lines.append(f"{rate:>12} {cell(d, '14.2f')} {cell(loc, '13.2f')} {cell(kv and kv / 1e6, '7.1f')} "
                     f"{cell(rx and rx / 1e6, '13.1f')} {cell(ms, '12.0f')}  {', '.join(choice) or '-'}")
        if d is not None and loc is not None:
            pays.append((rate, d < loc))
    paying = [r for r, ok in pays if ok]
    lines.append("disaggregation pays (lower median TTFT than the decode's own prefill) at: "
                 + (", ".join(paying) if paying else "none of these rates"))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench network", description=(
        "TTFT of long prompts with prefill and decode on separate hosts (network namespaces, "
        "UCX over TCP) at tc-shaped link rates: disaggregated vs the decode's own prefill. "
        "Link delay is not emulated (no netem). Needs root and iproute2."))
    p.add_argument("--rates", default="0.2,1,10,unshaped", help="link rates in Gbit/s, or 'unshaped' (default %(default)s)")
    p.add_argument("--modes", default="disaggregated,local", help=f"of {','.join(MODES)} (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=2048, help="tokens per prompt (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="prompts per rate and mode (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens generated per prompt (default %(default)s)")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per worker (default %(default)s)")
    p.add_argument("--json", help="also write the samples to this file")
    p.add_argument("--plot", help="also plot TTFT per rate and mode to this file (.svg, .png or .pdf; needs "
                                  "matplotlib, the bench extra)")
    args = p.parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib: pip install 'pdserve[bench]'")
    reason = unavailable()
    if reason:
        print(f"pdserve bench network: {reason}", file=sys.stderr)
        return 2
    from pdserve.security.secret import ClusterSecret

    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}")
    import tempfile

    worker_args = ["--kv-backends", "ucx", "--failure-policy", "fail", "--num-threads", str(args.num_threads),
                   "--max-kv-tokens", str(4 * args.prompt_tokens), "--heartbeat-s", "0.5",
                   "--transfer-timeout-s", "120", "--prefill-timeout-s", "300"]
    prompts = iter(long_prompts(args.prompt_tokens, len(rates) * len(modes) * args.repeats))
    samples: list[Sample] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-netlab-") as tmp:
        secret = os.path.join(tmp, "cluster-secret")
        ClusterSecret.create(secret)
        for mode in modes:
            print(f"{mode}:", flush=True)
            samples += measure(mode, rates, prompts, args.repeats, worker_args, secret, args.max_tokens)
    print(table(samples, rates))
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(s) for s in samples], indent=1))
    if args.plot:
        from pdserve.bench.network_plot import write_plot

        print(f"plot: {write_plot(samples, rates, args.plot, args.prompt_tokens)}")
    return 0

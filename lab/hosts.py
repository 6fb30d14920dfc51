"""The network lab: N hosts as Linux network namespaces on one switch, for services that must
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
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Iterator, Sequence

from pdserve.lab.namespaces import NETNS_DIR, LabError, ip, new_tag, remove_netns, sweep_orphans
from pdserve.lab.reaper import REAPER
from pdserve.lab.services import Service, die_with_lab

CLONE_NEWNET = 0x40000000


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



class Lab:
    """Hosts `names` on one switch, addresses `subnet`.10, .11, ... in that order."""

    def __init__(self, names: Sequence[str], subnet: str = "10.77.0") -> None:
        if len(set(names)) != len(names) or not all(re.fullmatch(r"[a-z][a-z0-9-]{0,15}", n) for n in names):
            raise ValueError(f"host names must be distinct, lowercase, at most 16 characters: {names}")
        tag = new_tag()
        self.switch = f"{tag}-switch"
        self.hosts = {n: Host(n, f"{tag}-{n}", f"{subnet}.{10 + i}", f"p{i}") for i, n in enumerate(names)}
        self.services: list[Service] = []
        self._made: list[str] = []  # namespaces, in creation order
        self._lock = threading.RLock()  # a signal may close the lab while its thread holds it
        self.closed = False

    def __enter__(self) -> "Lab":
        REAPER.adopt(self)
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
        sweep_orphans()
        self._add_netns(self.switch)
        ip("-n", self.switch, "link", "add", "name", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts.values():
            self._add_netns(host.netns)
            ip("link", "add", "name", host.dev, "netns", host.netns, "type", "veth", "peer", "name", host.port,
                "netns", self.switch)
            ip("-n", self.switch, "link", "set", host.port, "master", "br0", "up")
            ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.dev)
            ip("-n", host.netns, "link", "set", host.dev, "up")
            ip("-n", host.netns, "link", "set", "lo", "up")

    def _add_netns(self, name: str) -> None:
        ip("netns", "add", name)
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
        ip("-n", self.switch, "link", "set", self.hosts[name].port, "down")

    def heal(self, name: str) -> None:
        ip("-n", self.switch, "link", "set", self.hosts[name].port, "up")

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
                                stdin=subprocess.DEVNULL, text=True, preexec_fn=die_with_lab,
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

    def http(self, host: str, url: str, body: dict | None = None, timeout_s: float = 120.0,
             headers: dict[str, str] | None = None) -> bytes:
        """One HTTP request (POST with a JSON `body`, else GET) from inside `host`; its body."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
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
            remove_netns(netns)
        self._made.clear()
        REAPER.release(self)


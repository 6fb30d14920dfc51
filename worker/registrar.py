"""Registration with every router a `--router` name resolves to."""
from __future__ import annotations

import asyncio

from pdserve.rpc.credentials import InternalTLS
from pdserve.proto.pdserve.v1 import registry_pb2
from pdserve.security.credentials import CallSigner
from pdserve.security.key_directory import PeerKeys
from pdserve.worker.kv_events import KVEventFanout
from pdserve.worker.registry_client import RegistryClient
from pdserve.worker.settings import WorkerSettings


def router_addresses(target: str) -> set[str]:
    """Every "host:port" that `target` resolves to (a Kubernetes headless Service lists each
    router pod); `target` itself when it does not resolve. IPv6 hosts come back bracketed."""
    import socket

    host, _, port = target.rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return {target}
    addrs = {f"[{i[4][0]}]:{port}" if ":" in i[4][0] else f"{i[4][0]}:{port}" for i in infos}
    return addrs or {target}


class Registrar:
    """Keeps this worker registered with every router while the service runs.

    `--router host:port` may name several routers: the name is resolved every
    `resolve_every_s`, each resolved address gets its own `RegistryClient` (register,
    heartbeat, re-register on NOT_FOUND, deregister on stop), and an address that no longer
    resolves has its client stopped without deregistering (that router is gone or not ready).
    With `kv_events`, each router also gets this worker's KV events (worker.kv_events).
    """

    def __init__(self, settings: WorkerSettings, info: registry_pb2.WorkerInfo, load_fn,
                 *, resolve_every_s: float = 15.0, signer: CallSigner | None = None,
                 tls: InternalTLS | None = None, peers: PeerKeys | None = None,
                 kv_events: KVEventFanout | None = None) -> None:
        """`peers`: learns each router's key, and where to look up peer workers' keys."""
        self.settings = settings
        self.signer = signer
        self.tls = tls
        self.peers = peers
        self.info = info
        self.load_fn = load_fn
        self.resolve_every_s = resolve_every_s
        self.kv_events = kv_events
        self._task: asyncio.Task | None = None
        self._clients: dict[str, RegistryClient] = {}

    @property
    def addresses(self) -> tuple[str, ...]:
        """The router addresses that currently have a client."""
        return tuple(sorted(self._clients))

    @property
    def registered(self) -> bool:
        """Registered with at least one router."""
        return any(c.registered for c in self._clients.values())

    def start(self) -> None:
        if self.settings.router:
            if self.kv_events is not None:
                self.kv_events.start()
            self._task = asyncio.create_task(self._resolve_forever())

    async def wait_registered(self, timeout_s: float) -> None:
        """TimeoutError unless some router accepted us within `timeout_s`."""
        async with asyncio.timeout(timeout_s):
            while not self.registered:
                await asyncio.sleep(0.05)

    def _client(self, address: str) -> RegistryClient:
        heartbeat_s = self.settings.heartbeat_s
        return RegistryClient(address, self.info, self.load_fn, heartbeat_s=heartbeat_s,
                              retry_s=min(0.5, heartbeat_s), max_retry_s=heartbeat_s,
                              rpc_timeout_s=5.0, register_timeout_s=10.0, signer=self.signer, tls=self.tls,
                              peers=self.peers, enrollment_token=self.settings.enrollment_token)

    async def _resolve_forever(self) -> None:
        while True:
            addrs = await asyncio.to_thread(router_addresses, self.settings.router)
            for addr in sorted(addrs - set(self._clients)):
                client = self._clients[addr] = self._client(addr)
                client.start()
                if self.kv_events is not None:
                    self.kv_events.attach(addr, client)
            for addr in set(self._clients) - addrs:
                if self.kv_events is not None:
                    await self.kv_events.detach(addr)
                await self._clients.pop(addr).stop(deregister=False)
            await asyncio.sleep(self.resolve_every_s)

    async def announce(self) -> bool:
        """Report the load to every router now (in parallel); True when each acknowledged."""
        answers = await asyncio.gather(*(c.report_now() for c in list(self._clients.values())))
        return all(answers)

    async def stop(self) -> None:
        """Stop resolving, deregister from every router (best effort, in parallel)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.kv_events is not None:
            await self.kv_events.stop()
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.stop() for c in clients))

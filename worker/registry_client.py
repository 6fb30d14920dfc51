"""The worker side of the Registry protocol: stay registered with the router.

    client = RegistryClient("127.0.0.1:50050", worker_info, load_fn)
    client.start()                      # inside the worker's event loop, after its server started
    await client.wait_registered(30.0)  # optional
    ...
    await client.stop()                 # deregisters (best effort)

Protocol (see registry.proto): Register until the router accepts (retrying with backoff
while it is unreachable or cannot reach us yet), then Heartbeat every interval the router
asked for. A Heartbeat (or a KV event batch) answered NOT_FOUND or UNAUTHENTICATED (router
restarted, or it declared us dead) means register again at once. `load_fn` is called for every report and must be cheap and
thread-safe with respect to the engine (a snapshot).

One client talks to one router address; `pdserve.worker.registrar.Registrar` keeps one client
per address a router name resolves to.

With a cluster secret, Register carries this process's public key (`signer.public_key`) and
the answer the router's: each registered router's key goes to `peers` (what verifies that
router's calls), with `lookup` (its registry's answer for a peer worker's key).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable

import grpc

from pdserve.proto.pdserve.v1 import common_pb2, kv_events_pb2, registry_pb2, registry_pb2_grpc
from pdserve.rpc.credentials import InternalTLS, internal_channel
from pdserve.security.credentials import CallSigner, Identity
from pdserve.security.enrollment import ENROLLMENT_HEADER
from pdserve.security.key_directory import PeerKeys

log = logging.getLogger("pdserve.registry_client")

MAX_RETRY_S = 10.0
MIN_INTERVAL_S = 0.05  # a router asking for a shorter heartbeat interval gets this one
# A router that answers a registered worker's call so does not know it (it restarted, or
# declared the worker dead): NOT_FOUND, or, with a cluster secret, UNAUTHENTICATED (it has no
# key for the worker's id until the worker registers again).
_UNKNOWN_HERE = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED)
_ROLE_NAMES = {registry_pb2.WORKER_ROLE_PREFILL: "prefill", registry_pb2.WORKER_ROLE_DECODE: "decode"}


class RegistryClient:
    def __init__(self, router_address: str, info: registry_pb2.WorkerInfo,
                 load_fn: Callable[[], common_pb2.WorkerLoad], *, heartbeat_s: float = 2.0,
                 rpc_timeout_s: float = 5.0, retry_s: float = 0.5, max_retry_s: float = MAX_RETRY_S,
                 register_timeout_s: float | None = None, signer: CallSigner | None = None,
                 tls: InternalTLS | None = None, peers: PeerKeys | None = None, enrollment_token: str = "") -> None:
        """`retry_s` doubles after each failed Register up to `max_retry_s`. Register may take
        longer than other calls (the router fetches ModelInfo from a new decode worker), hence
        `register_timeout_s` (default `rpc_timeout_s`). `enrollment_token`: this worker's own
        (security.enrollment), shown at every Register."""
        self._address = router_address
        self._enrollment = ((ENROLLMENT_HEADER, enrollment_token),) if enrollment_token else None
        self._signer = signer
        self._tls = tls
        self._peers = peers if peers is not None else PeerKeys()  # none given: what it learns goes unused
        self._stub: registry_pb2_grpc.RegistryStub | None = None
        self._info = info
        self._load_fn = load_fn
        self._configured_s = heartbeat_s
        self._interval_s = heartbeat_s  # the router's ask caps it (see _take_interval)
        self._rpc_timeout_s = rpc_timeout_s
        self._register_timeout_s = register_timeout_s or rpc_timeout_s
        self._retry_s = retry_s
        self._max_retry_s = max(retry_s, max_retry_s)
        self._registered = asyncio.Event()
        self._wake = asyncio.Event()  # set: register now (a KV event batch found the router does not know us)
        self._task: asyncio.Task | None = None
        self._channel: grpc.aio.Channel | None = None
        self.num_registrations = 0  # how often Register succeeded (re-registrations included)
        self._lease = b""  # RegisterResponse.lease of the live registration: only this process holds it
        self.num_refused = 0  # Register attempts that failed (router down, refused, timed out)

    @property
    def address(self) -> str:
        return self._address

    @property
    def registered(self) -> bool:
        return self._registered.is_set()

    def start(self) -> None:
        self._channel = internal_channel(self._address, self._signer, self._tls)
        self._stub = registry_pb2_grpc.RegistryStub(self._channel)
        self._task = asyncio.get_running_loop().create_task(self._run(self._stub))

    async def wait_registered(self, timeout_s: float) -> None:
        """TimeoutError unless the router accepted us within `timeout_s`."""
        await asyncio.wait_for(self._registered.wait(), timeout_s)

    async def stop(self, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            # gather, not `suppress(CancelledError)`: a cancellation of our caller must go on
            (outcome,) = await asyncio.gather(self._task, return_exceptions=True)
            if isinstance(outcome, Exception):
                log.error("registration loop for router %s had stopped: %r", self._address, outcome)
        if deregister and self._channel is not None and self.registered:
            stub = registry_pb2_grpc.RegistryStub(self._channel)
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.Deregister(registry_pb2.DeregisterRequest(worker_id=self._info.worker_id,
                                                                     reason="shutdown", lease=self._lease),
                                      timeout=self._rpc_timeout_s)
        self._registered.clear()
        self._peers.forget_router(self._address)
        if self._channel is not None:
            await self._channel.close()

    async def lookup(self, worker_id: str) -> Identity | None:
        """The identity this router's registry holds for `worker_id`; None when it has none;
        ConnectionError when it does not answer (security.key_directory.Lookup)."""
        try:
            answer = await self._stub.Lookup(registry_pb2.LookupRequest(worker_id=worker_id),
                                             timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as err:
            raise ConnectionError(f"{err.code().name} {err.details()}") from None
        if not answer.found or answer.role not in _ROLE_NAMES:
            return None
        return Identity(worker_id, _ROLE_NAMES[answer.role], answer.public_key)

    async def _run(self, stub: registry_pb2_grpc.RegistryStub) -> None:
        backoff_s = self._retry_s
        while True:
            if not self.registered:
                if await self._register(stub):
                    backoff_s = self._retry_s
                else:
                    await asyncio.sleep(backoff_s)
                    backoff_s = min(2 * backoff_s, self._max_retry_s)
                    continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval_s)
            if self._wake.is_set():
                self._wake.clear()
                continue
            await self._heartbeat(stub)

    async def _register(self, stub: registry_pb2_grpc.RegistryStub) -> bool:
        public_key = self._signer.public_key if self._signer is not None else b""
        request = registry_pb2.RegisterRequest(worker=self._info, load=self._load(), lease=self._lease,
                                               public_key=public_key)
        self._peers.registering(self._address, True)
        try:
            answer = await stub.Register(request, timeout=self._register_timeout_s, metadata=self._enrollment)
        except grpc.aio.AioRpcError as err:
            log.warning("register with router %s failed: %s %s", self._address, err.code().name, err.details())
            self.num_refused += 1
            return False
        finally:
            self._peers.registering(self._address, False)
        self._take_interval(answer.heartbeat_interval_ms)
        self._lease = answer.lease
        self._peers.set_router(self._address, answer.router_public_key, self.lookup)
        self.num_registrations += 1
        self._registered.set()
        log.info("registered %s with router %s (heartbeat every %.2f s)", self._info.worker_id, self._address,
                 self._interval_s)
        return True

    async def report_now(self) -> bool:
        """One heartbeat now, out of turn (a draining worker's news must not wait an
        interval); True when the router acknowledged it."""
        if self._stub is None or not self.registered:
            return False
        return await self._heartbeat(self._stub)

    async def _heartbeat(self, stub: registry_pb2_grpc.RegistryStub) -> bool:
        request = registry_pb2.HeartbeatRequest(worker_id=self._info.worker_id, load=self._load(), lease=self._lease)
        try:
            answer = await stub.Heartbeat(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as err:
            if err.code() in _UNKNOWN_HERE:
                log.info("router %s does not know %s (%s): registering again", self._address, self._info.worker_id,
                         err.code().name)
                self._registered.clear()
            else:
                log.warning("heartbeat to router %s failed: %s %s", self._address, err.code().name, err.details())
            return False
        self._take_interval(answer.heartbeat_interval_ms)
        return True

    async def publish_kv_events(self, batch: kv_events_pb2.KVEventBatch) -> kv_events_pb2.KVEventAck | None:
        """Send one batch of KV events (worker id and lease filled here). None when the router
        did not take it (unreachable, or it does not know us: then register again at once)."""
        if self._stub is None or not self.registered:
            return None
        request = kv_events_pb2.KVEventBatch()
        request.CopyFrom(batch)
        request.worker_id, request.lease = self._info.worker_id, self._lease
        try:
            return await self._stub.PublishKVEvents(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as err:
            if err.code() in _UNKNOWN_HERE:
                log.info("router %s does not know %s (KV events, %s): registering again", self._address,
                         self._info.worker_id, err.code().name)
                self._registered.clear()
                self._wake.set()
            else:
                log.debug("KV events to router %s: %s %s", self._address, err.code().name, err.details())
            return None

    def _load(self) -> common_pb2.WorkerLoad:
        """The load to report; a failing `load_fn` costs one report's numbers, never the loop
        (a dead loop would let the router drop a healthy worker)."""
        try:
            return self._load_fn()
        except Exception:  # noqa: BLE001 - a heartbeat must go out even if the report cannot be built
            log.exception("load report for router %s failed: sending an empty one", self._address)
            return common_pb2.WorkerLoad()

    @property
    def interval_s(self) -> float:
        return self._interval_s

    def _take_interval(self, heartbeat_interval_ms: int) -> None:
        """The router's ask is the longest gap it tolerates; a worker configured to report
        more often (fresher load and prefix reports) keeps its own, shorter interval."""
        if heartbeat_interval_ms:  # 0: the router did not say
            self._interval_s = max(MIN_INTERVAL_S, min(self._configured_s, heartbeat_interval_ms / 1000.0))

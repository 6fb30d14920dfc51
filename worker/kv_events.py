"""KV events: what this worker's tiers hold, told to every router as it changes.

    log = KVEventLog()
    attach_kv_events(engine, log)        # the pool (and each tier) calls log.on_event
    fanout = KVEventFanout(log)          # batches, one bounded queue per router
    registrar = Registrar(..., kv_events=fanout)

The engine's thread records events (`KVEventLog.on_event`); it never waits: the log's buffer
is bounded, and an event that does not fit is dropped. The log also keeps what each tier
holds (a mirror of the events), so a dropped event costs the routers a snapshot
(`KVEventLog.snapshot`, served as KVEvents.Snapshot), never a wrong index. Every event gets
the next sequence number of this incarnation (a random id drawn at start), dropped or not:
a router sees a drop as a gap in the numbers (kv_events.proto states the protocol).

Batches leave every `flush_s`, or at once when `batch_events` are waiting. Each router has its
own sender with a bounded queue of batches (a slow or absent router loses its oldest batches,
which it sees as a gap); an idle sender sends an empty batch every `probe_s`, which tells a
router that restarted about this worker at once (NOT_FOUND: register again).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import threading
from dataclasses import dataclass

from pdserve.proto.pdserve.v1 import kv_events_pb2, kv_events_pb2_grpc
from pdserve.rpc.errors import grpc_errors

log = logging.getLogger("pdserve.worker.kv_events")

TIERS = ("device", "host", "disk", "redis")  # fastest first: the order routers rank a hit by
_KINDS = {"stored": kv_events_pb2.KV_EVENT_KIND_STORED, "removed": kv_events_pb2.KV_EVENT_KIND_REMOVED}
MAX_HASHES_PER_EVENT = 256  # consecutive events of one tier and kind merge up to this


@dataclass(slots=True)
class _Event:
    tier: str
    kind: str
    block_hashes: list[int]


class KVEventLog:
    """The engine's side: records events, mirrors what each tier holds. Thread-safe; the
    engine's thread writes, the event loop takes batches and snapshots."""

    def __init__(self, max_pending_events: int = 8192, batch_events: int = 256) -> None:
        self.incarnation = secrets.randbits(63) or 1
        self._lock = threading.Lock()
        self._holds: dict[str, set[int]] = {tier: set() for tier in TIERS}
        self._pending: list[_Event] = []
        self._first_pending_seq = 1  # the sequence number of _pending[0]
        self._next_seq = 1
        self._sealed_seq = 0  # events up to here are in a snapshot: never merged into again
        self._max_pending = max_pending_events
        self.batch_events = batch_events
        self._wake = lambda: None
        self.num_dropped = 0

    def set_wake(self, wake) -> None:
        """`wake()` is called (from any thread) when a full batch is waiting."""
        self._wake = wake

    def on_event(self, tier: str, kind: str, block_hashes: list[int]) -> None:
        """The pool's and the tiers' callback (engine.block_pool's `on_event`)."""
        if tier not in self._holds or kind not in _KINDS or not block_hashes:
            return
        with self._lock:
            held = self._holds[tier]
            if kind == "stored":
                held.update(block_hashes)
            else:
                held.difference_update(block_hashes)
            last = self._pending[-1] if self._pending else None
            last_seq = self._first_pending_seq + len(self._pending) - 1
            # merge only into the newest numbered event, and only one no snapshot has covered
            if (last is not None and last.tier == tier and last.kind == kind and last_seq == self._next_seq - 1
                    and last_seq > self._sealed_seq and len(last.block_hashes) + len(block_hashes) <= MAX_HASHES_PER_EVENT):
                last.block_hashes.extend(block_hashes)
                return
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            # a batch's events are numbered from its first on: after a drop, nothing joins the
            # buffer until it is empty (the gap in the numbers then tells the routers)
            if len(self._pending) >= self._max_pending or (self._pending and last_seq != seq - 1):
                self.num_dropped += 1
                return
            if not self._pending:
                self._first_pending_seq = seq
            self._pending.append(_Event(tier, kind, list(block_hashes)))
            full = len(self._pending) >= self.batch_events
        if full:
            self._wake()

    def take_batch(self) -> kv_events_pb2.KVEventBatch:
        """The oldest `batch_events` waiting, as a batch (empty: a probe carrying the next
        sequence number; a batch stays well under the registry's message limit). The worker
        id and lease are the sender's to fill."""
        with self._lock:
            events, self._pending = self._pending[:self.batch_events], self._pending[self.batch_events:]
            first = self._first_pending_seq if events else self._next_seq
            self._first_pending_seq += len(events)
        return kv_events_pb2.KVEventBatch(
            incarnation=self.incarnation, first_seq=first,
            events=[kv_events_pb2.KVEvent(tier=e.tier, kind=_KINDS[e.kind], block_hashes=e.block_hashes)
                    for e in events])

    def snapshot(self) -> kv_events_pb2.KVSnapshotResponse:
        """Every tier's hashes as of the last numbered event."""
        with self._lock:
            last = self._next_seq - 1
            self._sealed_seq = last
            tiers = [(tier, list(held)) for tier, held in self._holds.items() if held]
        return kv_events_pb2.KVSnapshotResponse(
            incarnation=self.incarnation, last_seq=last,
            tiers=[kv_events_pb2.KVTierBlocks(tier=t, block_hashes=h) for t, h in tiers])

    def holds(self, tier: str) -> set[int]:
        """A copy of what `tier` holds now (tests compare the routers' index with it)."""
        with self._lock:
            return set(self._holds[tier])


def attach_kv_events(engine, events: KVEventLog) -> KVEventLog:
    """Route the engine's pool events, and those of the tiers under it (where its connector
    has them: kvtransfer.tiers), into `events`; returns `events`."""
    tiers = getattr(engine.connector, "tiers", None)
    if tiers is not None:
        tiers.set_on_event(events.on_event)  # the pool's events pass through the tiers' hook
    else:
        engine.kv.pool.on_event = events.on_event
    return events


class KVEventsService(kv_events_pb2_grpc.KVEventsServicer):
    """KVEvents.Snapshot: routers only (security.credentials.CALLER_ROLES)."""

    def __init__(self, events: KVEventLog) -> None:
        self._events = events

    @grpc_errors
    async def Snapshot(self, request, context):
        return self._events.snapshot()


KV_EVENTS_SERVICE = "pdserve.v1.KVEvents"


def with_kv_events_service(add_servicers, service_names: list[str], events: KVEventLog):
    """A role's (add_servicers, service names) with KVEvents added."""
    def add(server) -> None:
        add_servicers(server)
        kv_events_pb2_grpc.add_KVEventsServicer_to_server(KVEventsService(events), server)

    return add, [*service_names, KV_EVENTS_SERVICE]


class KVEventSender:
    """One router's queue of batches and the task that sends them in order through that
    router's `RegistryClient`. Full queue: the oldest batch goes (the router sees a gap)."""

    def __init__(self, client, max_batches: int = 64, retry_s: float = 0.2) -> None:
        self._client = client
        self._queue: collections.deque[kv_events_pb2.KVEventBatch] = collections.deque(maxlen=max_batches)
        self._ready = asyncio.Event()
        self._retry_s = retry_s
        self._task: asyncio.Task | None = None
        self.num_sent = 0

    def offer(self, batch: kv_events_pb2.KVEventBatch) -> None:
        self._queue.append(batch)
        self._ready.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._queue:
                await self._send(self._queue.popleft())

    async def _send(self, batch: kv_events_pb2.KVEventBatch) -> None:
        """Until the router takes `batch`; given up when this worker is not registered there
        (its registration brings a snapshot) or when newer batches fill the queue meanwhile."""
        while self._client.registered:
            if await self._client.publish_kv_events(batch) is not None:
                self.num_sent += 1
                return
            if len(self._queue) == self._queue.maxlen:
                return  # the oldest batch goes: the router sees the gap
            await asyncio.sleep(self._retry_s)
        self._queue.clear()


class KVEventFanout:
    """Takes the log's batches every `flush_s` (or when one is full) and offers each to every
    router's sender; with nothing to send for `probe_s`, an empty batch goes instead."""

    def __init__(self, events: KVEventLog, flush_s: float = 0.05, probe_s: float = 0.5,
                 max_batches: int = 64) -> None:
        self.events = events
        self._flush_s = flush_s
        self._probe_s = probe_s
        self._max_batches = max_batches
        self._senders: dict[str, KVEventSender] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def attach(self, address: str, client) -> None:
        sender = self._senders[address] = KVEventSender(client, self._max_batches)
        sender.start()

    async def detach(self, address: str) -> None:
        sender = self._senders.pop(address, None)
        if sender is not None:
            await sender.stop()

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.events.set_wake(lambda: loop.call_soon_threadsafe(self._wake.set))
        self._task = loop.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for address in list(self._senders):
            await self.detach(address)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last_sent = loop.time()
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._flush_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            while True:
                batch = self.events.take_batch()
                if not batch.events and loop.time() - last_sent < self._probe_s:
                    break
                last_sent = loop.time()
                for sender in self._senders.values():
                    sender.offer(batch)
                if len(batch.events) < self.events.batch_events:
                    break

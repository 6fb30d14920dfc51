"""What each worker holds, per tier, from its KV events (kv_events.proto states the protocol).

`KVIndex` is one worker's: the hashes of each tier, the worker's incarnation and the next
sequence number expected. It is *synced* while its numbers follow on; a gap, a new
incarnation or a new registration (this router may have restarted, or the worker) makes it
ask the worker for a snapshot, and batches that arrive while the snapshot is on its way are
held and replayed past the snapshot's last event. While unsynced the index keeps what it
knew: a stale hit costs one recomputed prefix, never a wrong answer (a worker verifies what
it finds by hash).

`KVEventIntake` takes batches (Registry.PublishKVEvents) and runs the snapshots.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import grpc

from pdserve.common.errors import InvalidRequestError, NotFoundError
from pdserve.proto.pdserve.v1 import kv_events_pb2, kv_events_pb2_grpc

log = logging.getLogger("pdserve.router.kv_index")

TIER_RANK = {"device": 0, "host": 1, "disk": 2, "redis": 2}  # lower: nearer the accelerator
MAX_HELD_BATCHES = 256  # batches kept while a snapshot is on its way; more: snapshot again


@dataclass(slots=True)
class KVIndex:
    """One worker's blocks per tier, as its events and snapshots tell."""

    max_blocks: int = 1 << 20  # per worker, all tiers together: a worker cannot grow the router without bound
    tiers: dict[str, set[int]] = field(default_factory=dict)
    incarnation: int = 0  # 0: none seen yet
    next_seq: int = 0  # 0: unknown (a snapshot is needed)
    syncing: bool = False  # a snapshot is on its way
    held: list[kv_events_pb2.KVEventBatch] = field(default_factory=list)
    num_blocks: int = 0
    num_snapshots: int = 0
    num_gaps: int = 0
    vouch: Callable[[Sequence[int]], Sequence[int]] | None = None  # the claims that count (`prefix_claims`)

    def tier_of(self, block_hash: int) -> str | None:
        """The nearest tier holding `block_hash`, or None."""
        best = None
        for tier, held in self.tiers.items():
            if block_hash in held and (best is None or TIER_RANK[tier] < TIER_RANK[best]):
                best = tier
        return best

    def leading_tiers(self, block_hashes: Sequence[int]) -> list[str]:
        """The nearest tier of each of the prompt's leading blocks, up to the first held nowhere."""
        found = []
        for block_hash in block_hashes:
            tier = self.tier_of(block_hash)
            if tier is None:
                break
            found.append(tier)
        return found

    def apply(self, batch: kv_events_pb2.KVEventBatch) -> bool:
        """Take `batch`; False when it leaves a gap (the caller asks for a snapshot)."""
        if self.syncing:
            if len(self.held) >= MAX_HELD_BATCHES:
                return False
            self.held.append(batch)
            return True
        if batch.incarnation != self.incarnation or batch.first_seq != self.next_seq or not self.next_seq:
            self.num_gaps += 1
            return False
        self._apply_events(batch.events)
        self.next_seq += len(batch.events)
        return True

    def begin_sync(self) -> None:
        self.syncing, self.held = True, []

    def finish_sync(self, snapshot: kv_events_pb2.KVSnapshotResponse) -> bool:
        """Replace the index with `snapshot`, then replay the held batches past it; False when
        they leave a gap (snapshot again)."""
        self.tiers, self.num_blocks = {}, 0
        for tiered in snapshot.tiers:
            _check_tier(tiered.tier)
            self._add(tiered.tier, tiered.block_hashes)
        self.incarnation, self.next_seq = snapshot.incarnation, snapshot.last_seq + 1
        self.num_snapshots += 1
        held, self.held, self.syncing = self.held, [], False
        for batch in held:
            if batch.incarnation != self.incarnation:
                return False
            skip = max(0, self.next_seq - batch.first_seq)
            if batch.first_seq > self.next_seq:
                return False
            events = batch.events[skip:]
            self._apply_events(events)
            self.next_seq += len(events)
        return True

    def fail_sync(self) -> None:
        self.syncing, self.held, self.next_seq = False, [], 0

    def _apply_events(self, events) -> None:
        for event in events:
            _check_tier(event.tier)
            if event.kind == kv_events_pb2.KV_EVENT_KIND_STORED:
                self._add(event.tier, event.block_hashes)
            elif event.kind == kv_events_pb2.KV_EVENT_KIND_REMOVED:
                held = self.tiers.get(event.tier)
                if held is not None:
                    before = len(held)
                    held.difference_update(event.block_hashes)
                    self.num_blocks -= before - len(held)

    def _add(self, tier: str, block_hashes) -> None:
        if self.vouch is not None:  # only blocks the router sent this worker count
            block_hashes = self.vouch(block_hashes)
        held = self.tiers.setdefault(tier, set())
        for block_hash in block_hashes:
            if self.num_blocks >= self.max_blocks:
                return
            if block_hash not in held:
                held.add(block_hash)
                self.num_blocks += 1


def _check_tier(tier: str) -> None:
    if tier not in TIER_RANK:
        raise InvalidRequestError(f"unknown KV tier {tier[:32]!r} ({', '.join(TIER_RANK)})", param="tier")


class KVEventIntake:
    """Batches in, snapshots out. `index_of(worker_id)` is the worker's index and address (None:
    not registered); `snapshot_stub(address)` a KVEvents stub to it; `spawn` runs a coroutine
    in the background."""

    def __init__(self, index_of: Callable[[str], tuple[KVIndex, str] | None],
                 snapshot_stub: Callable[[str], kv_events_pb2_grpc.KVEventsStub],
                 spawn: Callable, rpc_timeout_s: float) -> None:
        self._index_of = index_of
        self._stub = snapshot_stub
        self._spawn = spawn
        self._timeout_s = rpc_timeout_s

    @classmethod
    def for_registry(cls, registry, channels, spawn: Callable, rpc_timeout_s: float) -> "KVEventIntake":
        """The intake of `registry`'s records (a `WorkerRegistry`), reaching workers through
        `channels` (a `WorkerChannels`)."""
        def index_of(worker_id: str) -> tuple[KVIndex, str] | None:
            record = registry.get(worker_id)
            return None if record is None else (record.kv, record.worker.address)

        return cls(index_of, channels.kv_events, spawn, rpc_timeout_s)

    def receive(self, batch: kv_events_pb2.KVEventBatch) -> bool:
        """Apply a batch from a registered worker (NOT_FOUND otherwise); False: it left a gap,
        and a snapshot is on its way."""
        found = self._index_of(batch.worker_id)
        if found is None:
            raise NotFoundError(f"worker {batch.worker_id!r} is not registered; register again", param="worker_id")
        index, _ = found
        if index.apply(batch):
            return True
        log.info("KV events of %s: gap at %d (expected %d, incarnation %x): snapshot", batch.worker_id,
                 batch.first_seq, index.next_seq, batch.incarnation)
        self.sync(batch.worker_id)
        return False

    def sync(self, worker_id: str) -> None:
        """Ask `worker_id` for a snapshot (unless one is on its way)."""
        found = self._index_of(worker_id)
        if found is None or found[0].syncing:
            return
        found[0].begin_sync()
        self._spawn(self._fetch(worker_id, found[0], found[1]))

    async def _fetch(self, worker_id: str, index: KVIndex, address: str) -> None:
        try:
            snapshot = await self._stub(address).Snapshot(kv_events_pb2.KVSnapshotRequest(), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as err:
            log.warning("KV snapshot of %s failed: %s %s", worker_id, err.code().name, err.details())
            index.fail_sync()
            return
        try:
            in_order = index.finish_sync(snapshot)
        except InvalidRequestError as err:
            log.warning("KV snapshot of %s refused: %s", worker_id, err)
            index.fail_sync()
            return
        log.debug("KV snapshot of %s: %d blocks as of event %d", worker_id, index.num_blocks, snapshot.last_seq)
        if not in_order:
            self.sync(worker_id)

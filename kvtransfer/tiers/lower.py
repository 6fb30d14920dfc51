"""A disk or Redis store as the tier below the host tier: it takes what the host tier evicts
(or, without a host tier, what the device pool evicts), written on the store's own thread,
sealed and keyed like every store record (`security.store_records`). Its reads are the
prefix store's (`connector.prefix_store.StoreLoads`): MAC, format and prefix digest checked,
a failing record a miss. Its bound is the store's (the disk store's byte and record budget,
Redis's TTL and maxmemory); going away turns it off with the store's reason, and it is back
on when a probe succeeds (`BlockStore.can_serve`)."""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from pdserve.engine.connector import KVCacheLayout
from pdserve.kernels.omp import one_intra_op_thread
from pdserve.kvtransfer.base import BlockStore
from pdserve.kvtransfer.codec import encode_message, new_transfer_id
from pdserve.kvtransfer.connector.background import Background
from pdserve.kvtransfer.sink import limits_for
from pdserve.kvtransfer.tiers.host import Demoted, EventHook, no_event
from pdserve.kvtransfer.tiers.stats import TierStats

log = logging.getLogger("pdserve.kvtransfer.tiers")

MAX_PENDING_BLOCKS = 4096  # demoted blocks queued for the store at most; more are dropped, counted


class StoreTier:
    def __init__(self, store: BlockStore, layout: KVCacheLayout, on_event: EventHook = no_event) -> None:
        self.store = store
        self.name = store.name
        self.on_event = on_event
        self._limits = limits_for(layout)
        self.stats = TierStats(store.name)
        self._pending = 0
        self._lock = threading.Lock()
        self._background = Background(ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pdkv-tier-{self.name}",
                                                         initializer=one_intra_op_thread))

    def take(self, items: Demoted) -> None:
        """Store these blocks in the background (any thread); dropped, counted, past the bound
        of blocks waiting or while the store is off."""
        with self._lock:
            if self._background.closed or self._pending + len(items) > MAX_PENDING_BLOCKS:
                with self.stats.lock:
                    self.stats.dropped += len(items)
                return
            self._pending += len(items)
        self._background.submit(self._write, list(items))

    def put_blocks(self, block_hashes, digests, blocks: torch.Tensor) -> None:
        """The offload's entry when this tier is the first below the pool (no host tier)."""
        self.take([(k, digests[i] if i < len(digests) else None, blocks[i]) for i, k in enumerate(block_hashes)])

    def _write(self, items: Demoted) -> None:
        try:
            if not self.store.can_serve():
                with self.stats.lock:
                    self.stats.dropped += len(items)
                return
            keys = [k for k, _, _ in items]
            blocks = torch.stack([t for _, _, t in items])
            message = encode_message(self._limits, new_transfer_id(), [0] * len(keys), keys, blocks)
            digests = [d for _, d, _ in items] if all(d is not None for _, d, _ in items) else []
            stored = self.store.put(keys, message, digests)
            with self.stats.lock:
                self.stats.blocks += stored
                self.stats.bytes += stored * message.payload_nbytes // max(1, len(keys))
                self.stats.dropped += len(keys) - stored
            if stored:
                self.on_event(self.name, "stored", keys[:stored] if stored == len(keys) else keys)
        finally:
            with self._lock:
                self._pending -= len(items)

    def refresh(self) -> TierStats:
        """Its stats with the store's own state: on/off and why, refused records, pruned ones."""
        health = self.store.health
        with self.stats.lock:
            self.stats.enabled = health.is_healthy
            self.stats.reason = "" if health.is_healthy else health.skip_reason()
            self.stats.corrupt = sum(int(getattr(self.store, name, 0)) for name in (
                "num_unauthenticated", "num_digest_mismatches", "num_corrupt"))
            self.stats.evictions = int(getattr(self.store, "num_pruned", 0))
        return self.stats.snapshot()

    def flush(self, timeout_s: float) -> bool:
        return self._background.flush(timeout_s)

    def close(self, timeout_s: float) -> None:
        self._background.close(timeout_s)

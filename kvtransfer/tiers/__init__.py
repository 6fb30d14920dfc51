"""The tiers under a worker's device pool: host memory, then the disk or Redis store.

    host.py     HostTier: a bounded pool of blocks in host memory (pinned on a GPU)
    lower.py    StoreTier: a disk or Redis store taking what the tier above evicts
    offload.py  Offloader: the device pool's evictions copied out on a thread of their own
    loads.py    TieredLoads: a request's hits in the tiers, verified, loaded before its forward
    stats.py    TierStats: blocks, bytes, hits, evictions, refused records, onboard time

Blocks move down on eviction: device pool -> host tier -> store (a tier that is missing is
skipped). A hit anywhere is loaded into the pool before the request's forward. The prefix
store also keeps its write-through of prompt blocks (`--prefix-store`): the policy of today.

Events: `Tiers.set_on_event(on_event)` installs one callback, `on_event(tier, kind,
block_hashes)`, called with tier "device", "host", "disk" or "redis" and kind "stored" or
"removed" as blocks enter or leave each tier (a store's own pruning and TTL expiry are not
seen by one worker and raise no event).
"""
from __future__ import annotations

from typing import Sequence

import torch

from pdserve.engine.connector import KVCacheLayout
from pdserve.kvtransfer.base import BlockStore
from pdserve.kvtransfer.tiers.host import EventHook, HostTier, no_demotion, no_event
from pdserve.kvtransfer.tiers.loads import TieredLoads
from pdserve.kvtransfer.tiers.lower import StoreTier
from pdserve.kvtransfer.tiers.offload import Offloader
from pdserve.kvtransfer.tiers.stats import TierStats

__all__ = ["HostTier", "Offloader", "StoreTier", "TierStats", "TieredLoads", "Tiers"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Tiers:
    """The tiers of one worker, wired to its pool by the connector's worker half."""

    def __init__(self, layout: KVCacheLayout, host_bytes: int, store: BlockStore | None,
                 max_pending_blocks: int = 1024, write_through: bool = True) -> None:
        """`store`: the prefix store, the tier below the host tier (None: none). With
        `write_through` the blocks a request generates are written to it as they fill, as a
        prefill writes a prompt's: another worker finds a chat's answers too."""
        self.layout = layout
        self.block_bytes = (layout.num_layers * 2 * layout.block_size * layout.num_kv_heads * layout.head_dim
                            * torch.empty((), dtype=_DTYPES[layout.dtype]).element_size())
        self._on_event: EventHook = no_event
        self.lower = StoreTier(store, layout, self._emit) if store is not None else None
        self.host: HostTier | None = None
        if host_bytes > 0:
            shape = (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
            self.host = HostTier(host_bytes, shape, _DTYPES[layout.dtype], on_event=self._emit,
                                 demote=self.lower.take if self.lower is not None else no_demotion)
        host = self.host if self.host is not None and self.host.capacity_blocks else None  # off below a block
        self.offloader: Offloader | None = None
        if host is not None:
            self.offloader = Offloader(host.put, host.stats, max_pending_blocks)
        elif self.lower is not None:
            self.offloader = Offloader(self.lower.put_blocks, self.lower.stats, max_pending_blocks)
        self.write_through = write_through and self.lower is not None
        self._pool = None

    def set_on_event(self, on_event: EventHook) -> None:
        """One callback for every tier's stored/removed blocks, the device pool's included."""
        self._on_event = on_event

    def _emit(self, tier: str, kind: str, block_hashes: list) -> None:
        self._on_event(tier, kind, list(block_hashes))

    def attach(self, kv_caches: Sequence[torch.Tensor]) -> None:
        if self.offloader is not None:
            self.offloader.attach(kv_caches)
        if self.host is not None and kv_caches and kv_caches[0].is_cuda:
            self.host.pin()

    def register_block_pool(self, kv) -> None:
        """Hook the engine's `KVCacheManager`: its pool's events and evictions, its fence."""
        self._pool = kv.pool
        kv.pool.on_event = self._emit
        if self.offloader is not None:
            kv.pool.on_evict = self.offloader.evicted
            kv.offload_fence = self.offloader.fence
            if self.write_through:
                kv.on_generated_blocks = self._write_through

    def _write_through(self, blocks) -> None:
        self.offloader.copy(blocks, self.lower.put_blocks)

    def stats(self) -> list[TierStats]:
        """A snapshot per tier, the device pool first."""
        out = []
        if self._pool is not None:
            pool = self._pool
            blocks = pool.num_cached_blocks
            out.append(TierStats("device", blocks=blocks, bytes=blocks * self.block_bytes,
                                 evictions=pool.num_evictions))
        if self.host is not None:
            out.append(self.host.stats.snapshot())
        if self.lower is not None:
            out.append(self.lower.refresh())
        return out

    def flush(self, timeout_s: float) -> bool:
        if self.offloader is not None:
            self.offloader.fence(timeout_s)
        return self.lower.flush(timeout_s) if self.lower is not None else True

    def close(self, timeout_s: float) -> None:
        """Stop the offload, free the host tier's memory, finish the store's writes."""
        if self.offloader is not None:
            self.offloader.close(min(timeout_s, 5.0))
        if self.host is not None:
            self.host.close()
        if self.lower is not None:
            self.lower.close(timeout_s)

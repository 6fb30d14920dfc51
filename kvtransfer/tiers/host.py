"""The host-memory tier: a bounded pool of KV blocks in host memory, below the device pool.

Blocks come in when the device pool evicts them (`Offloader`); a hit is copied back into
the pool before the request's forward (`TieredLoads`). On a GPU the pool is pinned memory:
copies to and from the device run at full PCIe speed without a staging copy. On CPU it is a
second, separate pool of blocks: the device pool stays the size the flags give it, and
what it evicts stays in memory instead of being recomputed.

Bounds: `capacity_bytes` is split into whole blocks once; a full tier evicts its least
recently used block (handed to `demote`, the tier below, as a copy) and never grows.
Every entry keeps its block's prefix digest: a hit must match the request's digest.
Thread-safe: the offload thread writes, the scheduler reads.
"""
from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from typing import Callable, Sequence

import torch

from pdserve.kvtransfer.tiers.stats import TierStats

log = logging.getLogger("pdserve.kvtransfer.tiers")

EventHook = Callable[[str, str, list], None]  # on_event(tier, kind, block_hashes)
Demoted = list  # [(block hash, digest or None, one block's tensor [L, 2, BS, H, D])]


def no_event(tier: str, kind: str, block_hashes: list) -> None:
    pass


def no_demotion(items: Demoted) -> None:
    pass


class HostTier:
    name = "host"

    def __init__(self, capacity_bytes: int, block_shape: Sequence[int], dtype: torch.dtype, *,
                 pin: bool = False, on_event: EventHook = no_event,
                 demote: Callable[[Demoted], None] = no_demotion) -> None:
        self.block_bytes = math.prod(block_shape) * torch.empty((), dtype=dtype).element_size()
        self.capacity_blocks = max(0, int(capacity_bytes) // self.block_bytes)
        self.on_event = on_event
        self.demote = demote
        self.stats = TierStats(self.name, capacity_bytes=self.capacity_blocks * self.block_bytes)
        self._lock = threading.Lock()
        self._index: OrderedDict[int, tuple[int, bytes | None]] = OrderedDict()  # hash -> slot, digest; LRU first
        self._free = list(range(self.capacity_blocks - 1, -1, -1))
        shape = (self.capacity_blocks, *block_shape)
        self._buffer: torch.Tensor | None = (torch.empty(shape, dtype=dtype, pin_memory=pin)
                                             if self.capacity_blocks else None)
        if not self.capacity_blocks:
            self.stats.enabled, self.stats.reason = False, "smaller than one block"

    def __len__(self) -> int:
        return len(self._index)

    def put(self, block_hashes: Sequence[int], digests: Sequence[bytes | None], blocks: torch.Tensor) -> int:
        """Take blocks `[N, L, 2, BS, H, D]` under their hashes; a full tier evicts its least
        recently used first (copied out before its slot is written). Returns blocks taken."""
        demoted: Demoted = []
        stored: list[int] = []
        with self._lock:
            if self._buffer is None:
                self.stats.dropped += len(block_hashes)
                return 0
            for i, key in enumerate(block_hashes):
                if key in self._index:
                    self._index.move_to_end(key)
                    continue
                if self._free:
                    slot = self._free.pop()
                else:
                    old, (slot, old_digest) = self._index.popitem(last=False)
                    demoted.append((old, old_digest, self._buffer[slot].clone()))
                self._buffer[slot].copy_(blocks[i])
                self._index[key] = (slot, digests[i] if i < len(digests) else None)
                stored.append(key)
            self._account(len(demoted))
        if demoted:
            self.on_event(self.name, "removed", [d[0] for d in demoted])
            self.demote(demoted)
        if stored:
            self.on_event(self.name, "stored", stored)
        return len(stored)

    def _account(self, evicted: int) -> None:
        with self.stats.lock:
            self.stats.blocks = len(self._index)
            self.stats.bytes = len(self._index) * self.block_bytes
            self.stats.evictions += evicted

    def match(self, block_hashes: Sequence[int], digests: Sequence[bytes] | None) -> list[torch.Tensor]:
        """Copies of the longest run of `block_hashes` held here with the same digests (a
        key held under another digest is another prefix's block: the run ends there)."""
        out: list[torch.Tensor] = []
        with self._lock:
            if self._buffer is None:
                return out
            for i, key in enumerate(block_hashes):
                entry = self._index.get(key)
                if entry is None:
                    break
                if digests is not None and entry[1] != digests[i]:
                    with self.stats.lock:
                        self.stats.corrupt += 1
                    break
                self._index.move_to_end(key)
                out.append(self._buffer[entry[0]].clone())
        return out

    def pin(self) -> None:
        """Move the (still empty) pool to pinned memory: a GPU worker's host tier."""
        with self._lock:
            if self._buffer is not None and not self._buffer.is_pinned():
                self._buffer = self._buffer.pin_memory()

    def holds(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._index

    def close(self) -> None:
        """Free the host memory. Idempotent."""
        with self._lock:
            held = list(self._index)
            self._index.clear()
            self._free = []
            self._buffer = None
            self._account(0)
            self.stats.enabled, self.stats.reason = False, "closed"
        if held:
            self.on_event(self.name, "removed", held)

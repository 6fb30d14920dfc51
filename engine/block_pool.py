"""The block pool: ref counts, an LRU free list, and the hash -> block map of prefix caching.

Invariants:
* a block is in the free list iff its ref count is 0 (block 0, the null block, never is);
* a free block may still carry a hash: it is a cached block, reusable until evicted. The free
  list's order is the eviction order (front = least recently freed = evicted first);
* `cached` maps a hash to exactly one block carrying that hash.

Two optional hooks, for the tiers under the pool (pdserve.kvtransfer.tiers):
* `on_evict(evicted)`: cached blocks leaving the cache to be reused, as `EvictedBlock`s
  (block id, hash, digest). Rule: a hook that copies their bytes must have copied them
  before the block is written again; the pool hands the block out right after the call,
  and `KVCacheManager.offload_fence` is what the scheduler waits on before any forward or
  transfer writes into it.
* `on_event(tier, kind, block_hashes)`: tier "device", kind "stored" when blocks are
  published by hash, "removed" when they leave the cache (evicted or reset).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

NULL_BLOCK_ID = 0  # never allocated; block tables point here for slots a window dropped


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    digest: bytes | None = None  # the full digest its hash was cut from (common.block_hash)


@dataclass(frozen=True, slots=True)
class EvictedBlock:
    """A cached block's id, key and digest, as a tier below the pool copies it out: evicted
    (`BlockPool.on_evict`) or just published (`KVCacheManager.on_generated_blocks`)."""

    block_id: int
    block_hash: int
    digest: bytes | None


def _no_eviction_hook(evicted: list[EvictedBlock]) -> None:
    pass


def _no_event_hook(tier: str, kind: str, block_hashes: list[int]) -> None:
    pass


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("a block pool needs at least 2 blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:])
        self._cached: dict[int, KVBlock] = {}
        self.num_evictions = 0
        self.on_evict: Callable[[list[EvictedBlock]], None] = _no_eviction_hook
        self.on_event: Callable[[str, str, list[int]], None] = _no_event_hook

    # -- queries ------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return len(self._free)

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    @property
    def num_cached_blocks(self) -> int:
        """Blocks published by hash (held or free). Safe to read from another thread."""
        return len(self._cached)

    def cached_hashes(self) -> list[int]:
        return list(self._cached)

    # -- allocation ---------------------------------------------------------------------
    def try_allocate(self, n: int) -> list[KVBlock] | None:
        """n fresh blocks (ref count 1), evicting cached free blocks LRU-first; None if short."""
        if n > len(self._free):
            return None
        out: list[KVBlock] = []
        evicted: list[EvictedBlock] = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None and self._cached.get(block.block_hash) is block:
                evicted.append(EvictedBlock(block.block_id, block.block_hash, block.digest))
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        if evicted:
            self.on_evict(evicted)
            self.on_event("device", "removed", [e.block_hash for e in evicted])
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on (possibly free, cached) blocks a request found by hash."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference on each. Pass blocks in eviction order: a request frees its
        blocks tail first, so its last blocks (least likely shared) are evicted first."""
        for block in blocks:
            if block.block_id == NULL_BLOCK_ID:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    self._free[block.block_id] = block
                    self._free.move_to_end(block.block_id, last=False)  # uncached: reuse first
                else:
                    self._free[block.block_id] = block

    # -- prefix caching -----------------------------------------------------------------
    def cache_full_block(self, block: KVBlock, block_hash: int, digest: bytes | None = None) -> None:
        """Publish a full block under its hash (first writer wins; duplicates stay private).
        `digest`: the prefix digest a later hit is checked against (KVCacheManager)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.digest = digest
        self._cached[block_hash] = block
        self.on_event("device", "stored", [block_hash])

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.digest = None
            self.num_evictions += 1

    def reset_prefix_cache(self) -> None:
        dropped = [block for block in self._cached.values() if block.ref_cnt == 0]
        hashes = [block.block_hash for block in dropped]
        for block in dropped:
            self._evict(block)
        if hashes:
            self.on_event("device", "removed", hashes)

    def assert_all_free(self) -> None:
        """Every usable block is back in the free list (the leak check tests end with)."""
        held = [b.block_id for b in self.blocks[1:] if b.ref_cnt != 0]
        if held or len(self._free) != self.num_usable_blocks:
            raise AssertionError(f"KV blocks still held: {held[:20]} ({len(held)} in all)")

"""The KV cache manager: per-layer cache tensors, and which blocks each request holds.

Resource-manager contract (what the scheduler and the services call): `prepare_resources`,
`update_resources`, `free_resources`, `get_max_resource_count`,
`get_needed_resource_to_completion`, `get_batch_cache_indices`, `get_buffers`,
`get_num_free_blocks`, `add_padding_request`.

Token t of a request lives in `blocks[t // block_size]` at offset `t % block_size`; its slot
id is `block_id * block_size + offset`. With an attention window W, once a block's last
token is older than the window it is returned to the pool and its table entry points at
the null block (never read: attention only reads the last W positions).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.common.util import available_memory_bytes, cdiv
from pdserve.engine.block_pool import NULL_BLOCK_ID, BlockPool, EvictedBlock, KVBlock
from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.engine.request import Request

log = logging.getLogger("pdserve.engine.kv_cache")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """What the prefix cache already holds for a request's prompt."""

    blocks: tuple[KVBlock, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


def size_num_blocks(model: ModelConfig, cache: CacheConfig, device: torch.device,
                    bytes_free: int | None = None) -> int:
    """Blocks to allocate: the smaller of `max_tokens` and `free_memory_fraction` of the memory
    free now, the weights loaded (CUDA: the device's free memory; CPU: what the OS reports
    available)."""
    if cache.num_blocks is not None:
        return cache.num_blocks + 1  # + the null block
    itemsize = torch.empty((), dtype=DTYPES[cache.dtype]).element_size()
    block_bytes = model.num_layers * 2 * cache.block_size * model.num_kv_heads * model.head_dim * itemsize
    if bytes_free is None:
        if device.type == "cuda":
            bytes_free, _ = torch.cuda.mem_get_info(device)
        else:
            bytes_free = available_memory_bytes()
    by_memory = int(bytes_free * cache.free_memory_fraction) // block_bytes
    by_tokens = cdiv(cache.max_tokens, cache.block_size) if cache.max_tokens else by_memory
    num = min(by_memory, by_tokens)
    if num < 1:
        raise ValueError("not enough memory for a single KV block")
    return num + 1


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor. On CPU through numpy's calloc, whose large allocations are
    fresh zero pages the OS commits on first write: a process's resident memory grows with
    the blocks it has used, not with the whole budget (torch.zeros writes every page)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class KVCacheManager:
    def __init__(self, model: ModelConfig, cache: CacheConfig, device: torch.device,
                 num_blocks: int | None = None) -> None:
        self.model = model
        self.config = cache
        self.block_size = cache.block_size
        self.device = device
        self.num_blocks = num_blocks or size_num_blocks(model, cache, device)
        self.pool = BlockPool(self.num_blocks, enable_caching=cache.enable_prefix_caching)
        shape = (self.num_blocks, 2, cache.block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [_zeros(shape, DTYPES[cache.dtype], device) for _ in range(model.num_layers)]
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks already published by hash
        self._num_dropped_blocks: dict[str, int] = {}  # leading blocks a window released
        self.num_digest_mismatches = 0  # cached blocks whose key matched but digest did not
        # extends a request's block keys over the full blocks it generated (engine.intake);
        # the engine sets it: without, only prompt blocks are published
        self.extend_block_hashes: Callable[[Request, int], None] = _keep_prompt_keys
        # waits until blocks evicted to a tier below have been copied out (BlockPool.on_evict):
        # the scheduler calls it once a step, before a forward or a transfer writes into them
        self.offload_fence: Callable[[], None] = _nothing_to_wait_for
        # blocks holding generated tokens, published just now: a tier that writes through (the
        # prefix store) copies them out, as the prefill does the prompt's (kvtransfer.tiers)
        self.on_generated_blocks: Callable[[list[EvictedBlock]], None] = _no_write_through

    # -- contract -----------------------------------------------------------------------
    def get_max_resource_count(self) -> int:
        return self.pool.num_usable_blocks

    def get_num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def get_buffers(self, layer_idx: int) -> torch.Tensor:
        """Layer `layer_idx`'s cache: `[num_blocks, 2, block_size, num_kv_heads, head_dim]`."""
        return self.kv_caches[layer_idx]

    def get_batch_cache_indices(self, request_ids: list[str]) -> list[list[int]]:
        """Block tables of several requests (resource-manager contract). No caller in the
        engine yet: the model runner builds its tables from `blocks_of`; kept for
        batch-oriented runners (CUDA graphs) and tested."""
        return [[b.block_id for b in self._blocks.get(rid, ())] for rid in request_ids]

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a request of `num_tokens` tokens holds at once (a window caps it)."""
        n = cdiv(num_tokens, self.block_size)
        window = self.config.attention_window
        if window is not None:
            n = min(n, cdiv(window, self.block_size) + 1)
        return n

    def get_needed_resource_to_completion(self, request: Request, max_model_len: int) -> int:
        """Blocks still to allocate for `request` to reach its max length (beyond those held)."""
        final = min(request.final_length, max_model_len)
        held = len(self._blocks.get(request.request_id, ())) - self._num_dropped_blocks.get(
            request.request_id, 0)
        return max(0, self.num_blocks_for_tokens(final) - held)

    def prepare_resources(self, request: Request, num_new_tokens: int) -> bool:
        """Make sure `request` has blocks for `num_computed_tokens + num_new_tokens` tokens.
        False (and nothing allocated) if the pool is short."""
        blocks = self._blocks.setdefault(request.request_id, [])
        need = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(blocks)
        if need <= 0:
            return True
        new = self.pool.try_allocate(need)
        if new is None:
            if not blocks:
                del self._blocks[request.request_id]
            return False
        blocks.extend(new)
        return True

    def update_resources(self, request: Request) -> None:
        """After a step: publish newly full blocks by hash, the prompt's and the generated ones
        (so the next turn of a chat, which repeats both, finds them); release blocks a window
        dropped. A block is full when all its positions are computed and their tokens known."""
        blocks = self._blocks.get(request.request_id)
        if not blocks:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if num_full > len(request.block_hashes):
            self.extend_block_hashes(request, min(num_full, len(blocks)))
        num_full = min(num_full, len(request.block_hashes), len(blocks))
        start = self._num_cached_blocks.get(request.request_id, 0)
        generated: list[EvictedBlock] = []
        for i in range(start, num_full):
            block = blocks[i]
            if block.block_id != NULL_BLOCK_ID:
                self.pool.cache_full_block(block, request.block_hashes[i], _digest(request, i))
                if (i + 1) * self.block_size > request.num_prompt_tokens and block.block_hash == request.block_hashes[i]:
                    generated.append(EvictedBlock(block.block_id, block.block_hash, block.digest))
        if generated:
            self.on_generated_blocks(generated)
        self._num_cached_blocks[request.request_id] = max(start, num_full)
        window = self.config.attention_window
        if window is not None:
            # the next query sits at position num_computed_tokens and reads positions
            # > num_computed_tokens - window; block i is dead once (i+1)*bs <= that bound + 1
            first_live = max(0, request.num_computed_tokens - window + 1) // self.block_size
            dropped = self._num_dropped_blocks.get(request.request_id, 0)
            if first_live > dropped:
                dead = blocks[dropped:first_live]
                self.pool.free(list(reversed(dead)))
                for i in range(dropped, first_live):
                    blocks[i] = self.pool.blocks[NULL_BLOCK_ID]
                self._num_dropped_blocks[request.request_id] = first_live

    def trim(self, request: Request) -> None:
        """Give back the blocks past the one `request`'s next token goes in (blocks allocated
        for positions that were computed and then not kept). The blocks it published by hash
        are kept; those past them were never published, so nothing else refers to them."""
        blocks = self._blocks.get(request.request_id)
        if not blocks:
            return
        keep = max(cdiv(request.num_computed_tokens + 1, self.block_size), self._num_cached_blocks.get(
            request.request_id, 0))
        if len(blocks) > keep:
            extra = blocks[keep:]
            del blocks[keep:]
            self.pool.free([b for b in reversed(extra) if b.block_id != NULL_BLOCK_ID])

    def free_resources(self, request_id: str) -> None:
        """Return every block of `request_id` to the pool (tail first). Idempotent."""
        blocks = self._blocks.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        self._num_dropped_blocks.pop(request_id, None)
        if blocks:
            self.pool.free([b for b in reversed(blocks) if b.block_id != NULL_BLOCK_ID])

    def add_padding_request(self, request_id: str, num_tokens: int) -> bool:
        """Hold blocks for a dummy request (warm-up / padded batches); free with free_resources.
        Resource-manager contract; no caller in the engine yet (CUDA-graph padding will be one)."""
        if request_id in self._blocks:
            raise ValueError(f"request {request_id} already holds blocks")
        new = self.pool.try_allocate(cdiv(max(1, num_tokens), self.block_size))
        if new is None:
            return False
        self._blocks[request_id] = new
        return True

    # -- prefix caching -----------------------------------------------------------------
    def find_prefix_hit(self, request: Request) -> PrefixHit:
        """Longest run of the prompt's full blocks already cached. At least one prompt token
        is always left to compute (its logits give the next token)."""
        max_blocks = (request.num_prompt_tokens - 1) // self.block_size
        hit: list[KVBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            if block.digest != _digest(request, i):  # a key collision: another prefix's KV
                self._refuse_collision(request, i)
                break
            hit.append(block)
        return PrefixHit(tuple(hit))

    def _refuse_collision(self, request: Request, index: int) -> None:
        self.num_digest_mismatches += 1
        if self.num_digest_mismatches == 1:  # logged once; counted always
            log.warning("prefix cache: block %d of request %s has a cached key but another prefix's "
                        "digest (a hash collision): treated as a miss", index, request.request_id)

    def num_free_blocks_after_taking(self, hit: PrefixHit) -> int:
        """Free blocks left once a request takes `hit`: a cached block of it that sits in the
        free list (no holder now) leaves the free list when taken."""
        return self.pool.get_num_free_blocks() - sum(1 for b in hit.blocks if b.ref_cnt == 0)

    def take_prefix_hit(self, request: Request, hit: PrefixHit) -> None:
        """Adopt `hit`'s blocks as `request`'s first blocks (before it holds any)."""
        if request.request_id in self._blocks:
            raise ValueError(f"request {request.request_id} already holds blocks")
        self.pool.touch(hit.blocks)
        self._blocks[request.request_id] = list(hit.blocks)
        self._num_cached_blocks[request.request_id] = hit.num_blocks

    def try_take_prefix_hit(self, request: Request, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Admit `request` (holding no blocks) into the cache: `hit`'s blocks as its first, and
        fresh blocks for `num_new_tokens` tokens after them. False, and nothing held, if the
        pool is short. The hit is taken first, so the allocation never evicts it."""
        self.take_prefix_hit(request, hit)
        need = cdiv(hit.num_blocks * self.block_size + num_new_tokens, self.block_size) - hit.num_blocks
        new = self.pool.try_allocate(need) if need > 0 else []
        if new is None:
            self.free_resources(request.request_id)
            return False
        self._blocks[request.request_id].extend(new)
        return True

    def blocks_of(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def assert_all_free(self) -> None:
        if self._blocks:
            raise AssertionError(f"requests still hold blocks: {sorted(self._blocks)[:10]}")
        self.pool.assert_all_free()


def _nothing_to_wait_for() -> None:
    pass


def _no_write_through(blocks: list[EvictedBlock]) -> None:
    pass


def _keep_prompt_keys(request: Request, num_blocks: int) -> None:
    """No block keys beyond the prompt's (an engine sets `extend_block_hashes`)."""


def _digest(request: Request, index: int) -> bytes | None:
    """The digest of `request`'s full block `index`; None when it has none (hand-built requests)."""
    return request.block_digests[index] if index < len(request.block_digests) else None

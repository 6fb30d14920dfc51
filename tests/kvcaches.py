"""Small helpers for the transfer layer's tests: tiny layouts, filled caches,
per-block digests to compare caches across processes, messages built from a cache."""
from __future__ import annotations

from typing import Sequence

import torch
import xxhash

from pdserve.engine.connector import KVCacheLayout
from pdserve.engine.kv_cache_manager import DTYPES
from pdserve.kvtransfer.base import BlockMessage
from pdserve.kvtransfer.blocks import gather_to_host
from pdserve.kvtransfer.codec import encode_message
from pdserve.kvtransfer.sink import limits_for



def tiny_layout(num_blocks: int = 32, num_layers: int = 2, block_size: int = 4,
                num_kv_heads: int = 2, head_dim: int = 8, dtype: str = "float32",
                model_name: str = "tiny") -> KVCacheLayout:
    return KVCacheLayout(model_name, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype)


def make_caches(layout: KVCacheLayout, seed: int | None = None) -> list[torch.Tensor]:
    """One cache tensor per layer: zeros, or seeded random values."""
    shape = (layout.num_blocks, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    caches = []
    for _ in range(layout.num_layers):
        if gen is None:
            caches.append(torch.zeros(shape, dtype=DTYPES[layout.dtype]))
        else:
            caches.append(torch.randn(shape, generator=gen).to(DTYPES[layout.dtype]))
    return caches


def block_digests(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> list[str]:
    """xxh64 hex of each block's bytes across all layers (bit-exact comparison)."""
    out = []
    for b in block_ids:
        h = xxhash.xxh64()
        for cache in kv_caches:
            h.update(cache[b].contiguous().view(torch.uint8).cpu().numpy().tobytes())
        out.append(h.hexdigest())
    return out


def message_from_cache(kv_caches: Sequence[torch.Tensor], layout: KVCacheLayout,
                       transfer_id: bytes, src_block_ids: Sequence[int],
                       dst_block_ids: Sequence[int],
                       block_hashes: Sequence[int] | None = None,
                       layers: range | None = None, digest: bool | None = None) -> BlockMessage:
    """Blocks `src_block_ids` of `kv_caches` bound for `dst_block_ids`: every layer, or the
    slice `layers` (a streamed message)."""
    hashes = list(block_hashes) if block_hashes is not None else [0] * len(src_block_ids)
    chosen = kv_caches if layers is None else kv_caches[layers.start:layers.stop]
    payload = gather_to_host(chosen, src_block_ids)
    return encode_message(limits_for(layout), transfer_id, dst_block_ids, hashes, payload, layers, digest)

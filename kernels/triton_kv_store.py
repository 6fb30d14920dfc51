"""Triton kernel: write each new token's K and V into its cache slot. Imported lazily."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,           # [T, KVH, D], token stride stride_key, (KVH, D) contiguous
    value_ptr,         # [T, KVH, D], token stride stride_value, (KVH, D) contiguous
    kv_cache_ptr,      # [num_blocks, 2, BLOCK_SIZE, KVH, D] contiguous
    slot_mapping_ptr,  # [T] int64, block_id * BLOCK_SIZE + offset, -1 = padding
    stride_key,
    stride_value,
    TOKEN_NUMEL: tl.constexpr,   # KVH * D
    TOKEN_PAD: tl.constexpr,     # next power of two >= TOKEN_NUMEL
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    cols = tl.arange(0, TOKEN_PAD)
    mask = cols < TOKEN_NUMEL
    k = tl.load(key_ptr + token * stride_key + cols, mask=mask)
    v = tl.load(value_ptr + token * stride_value + cols, mask=mask)
    # K of (block, offset) starts at ((block * 2 + 0) * BLOCK_SIZE + offset) * TOKEN_NUMEL;
    # its V is one half-block (BLOCK_SIZE * TOKEN_NUMEL) further.
    k_base = (block * 2 * BLOCK_SIZE + offset) * TOKEN_NUMEL
    tl.store(kv_cache_ptr + k_base + cols, k, mask=mask)
    tl.store(kv_cache_ptr + k_base + BLOCK_SIZE * TOKEN_NUMEL + cols, v, mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    token_numel = num_kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping, key.stride(0), value.stride(0),
        TOKEN_NUMEL=token_numel, TOKEN_PAD=triton.next_power_of_2(token_numel),
        BLOCK_SIZE=kv_cache.shape[2], num_warps=4 if token_numel >= 1024 else 1)

"""Triton kernels: copy whole cache blocks (every layer) to and from one contiguous
transfer buffer. Imported lazily.

The buffer is block-major, `[N, num_layers, 2, block_size, kv_heads, head_dim]`: block n's
bytes for all layers are one contiguous run, which the transfer layer sends and hashes.
One launch per layer (layers are separate tensors); each program copies one CHUNK of one
block's per-layer data, `BLOCK_NUMEL = 2 * block_size * kv_heads * head_dim` elements.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

_CHUNK = 4096  # elements per program: 8 KiB of bf16


@triton.jit
def _gather_layer_kernel(
    cache_ptr,      # [num_blocks, BLOCK_NUMEL] one layer, contiguous
    buffer_ptr,     # [N, num_layers, BLOCK_NUMEL] contiguous
    block_ids_ptr,  # [N] int64
    layer,
    num_layers,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = cols < BLOCK_NUMEL
    block = tl.load(block_ids_ptr + n)
    data = tl.load(cache_ptr + block * BLOCK_NUMEL + cols, mask=mask)
    tl.store(buffer_ptr + (n * num_layers + layer) * BLOCK_NUMEL + cols, data, mask=mask)


@triton.jit
def _scatter_layer_kernel(
    buffer_ptr,     # [N, num_layers, BLOCK_NUMEL] contiguous
    cache_ptr,      # [num_blocks, BLOCK_NUMEL] one layer, contiguous
    block_ids_ptr,  # [N] int64, distinct
    layer,
    num_layers,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = cols < BLOCK_NUMEL
    block = tl.load(block_ids_ptr + n)
    data = tl.load(buffer_ptr + (n * num_layers + layer) * BLOCK_NUMEL + cols, mask=mask)
    tl.store(cache_ptr + block * BLOCK_NUMEL + cols, data, mask=mask)


def _grid(num_blocks: int, block_numel: int) -> tuple[int, int, int]:
    chunk = min(_CHUNK, triton.next_power_of_2(block_numel))
    return num_blocks, triton.cdiv(block_numel, chunk), chunk


def gather_blocks(kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if block_ids.numel() == 0:
        return out
    block_numel = kv_caches[0][0].numel()
    n, chunks, chunk = _grid(block_ids.numel(), block_numel)
    for layer_idx, layer in enumerate(kv_caches):
        _gather_layer_kernel[(n, chunks)](layer, out, block_ids, layer_idx, len(kv_caches),
                                          BLOCK_NUMEL=block_numel, CHUNK=chunk, num_warps=4)
    return out


def scatter_blocks(buffer: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor) -> None:
    if block_ids.numel() == 0:
        return
    block_numel = kv_caches[0][0].numel()
    n, chunks, chunk = _grid(block_ids.numel(), block_numel)
    for layer_idx, layer in enumerate(kv_caches):
        _scatter_layer_kernel[(n, chunks)](buffer, layer, block_ids, layer_idx, len(kv_caches),
                                           BLOCK_NUMEL=block_numel, CHUNK=chunk, num_warps=4)

"""Public wrappers: copy whole blocks (all layers) into one transfer buffer and back."""
from __future__ import annotations

from typing import Sequence

import torch

from pdserve.kernels import torch_paths
from pdserve.kernels.checks import CacheShape, check_index, check_layer_caches, check_same_device, require
from pdserve.kernels.dispatch import use_triton


def buffer_shape(kv_caches: Sequence[torch.Tensor], num_blocks: int) -> tuple[int, ...]:
    """`[N, num_layers, 2, block_size, num_kv_heads, head_dim]`."""
    return (num_blocks, len(kv_caches)) + tuple(kv_caches[0].shape[1:])


def gather_blocks(kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy blocks `block_ids` (int64 `[N]`) of every layer into a contiguous block-major
    buffer: `out[n, layer] = kv_caches[layer][block_ids[n]]`. Writes into `out` when given.

    Block ids are range-checked (a device->host read): they may come from a peer.
    """
    cache = check_layer_caches(kv_caches)
    _check_block_ids(block_ids, cache, kv_caches[0].device)
    shape = buffer_shape(kv_caches, block_ids.shape[0])
    if out is None:
        out = torch.empty(shape, dtype=kv_caches[0].dtype, device=kv_caches[0].device)
    _check_buffer(out, "out", shape, kv_caches[0])
    if use_triton(out.device):
        from pdserve.kernels import triton_block_copy

        return triton_block_copy.gather_blocks(kv_caches, block_ids, out)
    return torch_paths.gather_blocks(kv_caches, block_ids, out)


def scatter_blocks(buffer: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor) -> None:
    """Inverse of `gather_blocks`: `kv_caches[layer][block_ids[n]] = buffer[n, layer]`.

    Block ids must be in range and distinct; both are checked (a device->host read), since
    they name the blocks a peer writes.
    """
    cache = check_layer_caches(kv_caches)
    _check_block_ids(block_ids, cache, kv_caches[0].device)
    _check_buffer(buffer, "buffer", buffer_shape(kv_caches, block_ids.shape[0]), kv_caches[0])
    if block_ids.numel() > 1:
        require(torch.unique(block_ids).numel() == block_ids.numel(), "block_ids holds a block twice")
    if use_triton(buffer.device):
        from pdserve.kernels import triton_block_copy

        triton_block_copy.scatter_blocks(buffer, kv_caches, block_ids)
    else:
        torch_paths.scatter_blocks(buffer, kv_caches, block_ids)


def _check_block_ids(block_ids: torch.Tensor, cache: CacheShape, device: torch.device) -> None:
    check_index(block_ids, "block_ids", torch.int64, (None,))
    require(block_ids.device == device, f"block_ids on {block_ids.device}, caches on {device}")
    if block_ids.numel():
        require(int(block_ids.min()) >= 0 and int(block_ids.max()) < cache.num_blocks,
                f"block_ids must lie in [0, {cache.num_blocks})")


def _check_buffer(buffer: torch.Tensor, name: str, shape: tuple[int, ...], like: torch.Tensor) -> None:
    require(isinstance(buffer, torch.Tensor), f"{name} must be a torch.Tensor")
    require(tuple(buffer.shape) == shape, f"{name} must be {shape}, got {tuple(buffer.shape)}")
    require(buffer.dtype == like.dtype, f"{name} dtype {buffer.dtype} != cache dtype {like.dtype}")
    check_same_device(**{name: buffer, "kv_caches": like})
    require(buffer.is_contiguous(), f"{name} must be contiguous")

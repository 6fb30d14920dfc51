"""Argument checks shared by the public kernel wrappers.

Every check here looks at shapes, strides, dtypes and devices only: nothing reads tensor
data, so nothing synchronises a GPU stream. The few data-dependent checks (block ids a
peer sent) live beside the wrapper that needs them and say so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pdserve.common.errors import PdserveError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class KernelArgumentError(PdserveError, ValueError):
    """A kernel wrapper was given tensors of the wrong shape, stride, dtype or device."""


@dataclass(frozen=True, slots=True)
class CacheShape:
    """The per-layer cache `[num_blocks, 2, block_size, num_kv_heads, head_dim]`."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int


def require(condition: bool, message: str) -> None:
    """For cold paths; hot checks below test first and format their message only on failure."""
    if not condition:
        raise KernelArgumentError(message)


def check_kv_cache(kv_cache: torch.Tensor, name: str = "kv_cache") -> CacheShape:
    if not isinstance(kv_cache, torch.Tensor):
        raise KernelArgumentError(f"{name} must be a torch.Tensor")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise KernelArgumentError(f"{name} must be [num_blocks, 2, block_size, num_kv_heads, head_dim], "
                                  f"got {tuple(kv_cache.shape)}")
    if kv_cache.dtype not in FLOAT_DTYPES:
        raise KernelArgumentError(f"{name} dtype {kv_cache.dtype} is not one of {FLOAT_DTYPES}")
    if not kv_cache.is_contiguous():
        raise KernelArgumentError(f"{name} must be contiguous (strides {kv_cache.stride()})")
    num_blocks, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if not (block_size > 0 and num_kv_heads > 0 and head_dim > 0):
        raise KernelArgumentError(f"{name} has an empty dimension: {tuple(kv_cache.shape)}")
    return CacheShape(num_blocks, block_size, num_kv_heads, head_dim)


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = [t.device for t in tensors.values()]
    if any(d != devices[0] for d in devices):
        raise KernelArgumentError("tensors must share one device, got " +
                                  ", ".join(f"{n}={t.device}" for n, t in tensors.items()))


def check_index(t: torch.Tensor, name: str, dtype: torch.dtype, shape: Sequence[int | None]) -> None:
    """An index tensor: exact dtype, rank and (where given) sizes, unit stride in its last dim."""
    if not isinstance(t, torch.Tensor):
        raise KernelArgumentError(f"{name} must be a torch.Tensor")
    if t.dtype != dtype:
        raise KernelArgumentError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(size is not None and t.shape[i] != size for i, size in enumerate(shape)):
        wanted = tuple("*" if size is None else size for size in shape)
        raise KernelArgumentError(f"{name} must be {wanted}, got {tuple(t.shape)}")
    if t.numel() and t.stride(-1) != 1:
        raise KernelArgumentError(f"{name} must have unit stride in its last dim, strides {t.stride()}")


def check_heads(t: torch.Tensor, name: str, cache: CacheShape, dtype: torch.dtype,
                num_heads: int | None = None) -> int:
    """A `[tokens, heads, head_dim]` activation matching the cache; returns its head count.

    The token dim may be strided (a view into a fused projection), the last dim may not.
    """
    if not isinstance(t, torch.Tensor) or t.dim() != 3:
        raise KernelArgumentError(f"{name} must be a [tokens, heads, head_dim] tensor")
    if t.shape[2] != cache.head_dim:
        raise KernelArgumentError(f"{name} head_dim {t.shape[2]} != cache head_dim {cache.head_dim}")
    if num_heads is not None and t.shape[1] != num_heads:
        raise KernelArgumentError(f"{name} has {t.shape[1]} heads, expected {num_heads}")
    if t.dtype != dtype:
        raise KernelArgumentError(f"{name} dtype {t.dtype} != kv_cache dtype {dtype}")
    if t.numel() and t.stride(2) != 1:
        raise KernelArgumentError(f"{name} must have unit stride in head_dim, strides {t.stride()}")
    return t.shape[1]


def check_gqa(num_heads: int, cache: CacheShape) -> int:
    """Returns the group size (query heads per KV head)."""
    if num_heads <= 0 or num_heads % cache.num_kv_heads:
        raise KernelArgumentError(
            f"num_heads {num_heads} is not a positive multiple of num_kv_heads {cache.num_kv_heads}")
    return num_heads // cache.num_kv_heads


def check_attention_scalars(scale: float, window: int | None) -> None:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise KernelArgumentError(f"scale must be a positive number, got {scale!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise KernelArgumentError(f"window must be None or an int >= 1, got {window!r}")


def check_layer_caches(kv_caches: Sequence[torch.Tensor]) -> CacheShape:
    """All layers' caches: same shape, dtype and device."""
    if len(kv_caches) == 0:
        raise KernelArgumentError("kv_caches is empty")
    first = kv_caches[0]
    cache = check_kv_cache(first, "kv_caches[0]")
    for i, layer in enumerate(kv_caches[1:], start=1):
        check_kv_cache(layer, f"kv_caches[{i}]")
        if layer.shape != first.shape or layer.dtype != first.dtype or layer.device != first.device:
            raise KernelArgumentError(
                f"kv_caches[{i}] is {tuple(layer.shape)} {layer.dtype} on {layer.device}, layer 0 is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}")
    return cache

"""Public wrapper: write new tokens' K/V into the paged cache."""
from __future__ import annotations

import torch

from pdserve.kernels import torch_paths
from pdserve.kernels.checks import KernelArgumentError, check_heads, check_index, check_kv_cache, check_same_device
from pdserve.kernels.dispatch import use_triton


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write `key[t]`/`value[t]` (`[T, num_kv_heads, head_dim]`) into slot `slot_mapping[t]`
    of one layer's `kv_cache`, in place. A slot is `block_id * block_size + offset`; slot -1
    marks a padding token, which is skipped.

    Slots must be distinct and in range. The CPU path checks the range; the Triton path does
    not (that would synchronise the stream): the engine computes slots, nobody else does.
    """
    cache = check_kv_cache(kv_cache)
    num_kv_heads = check_heads(key, "key", cache, kv_cache.dtype, cache.num_kv_heads)
    check_heads(value, "value", cache, kv_cache.dtype, num_kv_heads)
    if value.shape != key.shape:
        raise KernelArgumentError(f"value {tuple(value.shape)} != key {tuple(key.shape)}")
    for name, t in (("key", key), ("value", value)):
        if t.numel() and t.stride(1) != cache.head_dim:
            raise KernelArgumentError(f"{name} must be contiguous in (num_kv_heads, head_dim), strides {t.stride()}")
    check_index(slot_mapping, "slot_mapping", torch.int64, (key.shape[0],))
    check_same_device(key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if use_triton(kv_cache.device):
        from pdserve.kernels import triton_kv_store

        triton_kv_store.store_kv(key, value, kv_cache, slot_mapping)
    else:
        torch_paths.store_kv(key, value, kv_cache, slot_mapping)

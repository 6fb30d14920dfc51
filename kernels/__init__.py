"""Kernels over the paged KV cache, each a Triton kernel beside a pure-torch reference.

Per layer the cache is `[num_blocks, 2, block_size, num_kv_heads, head_dim]` (dim 1: 0 = K,
1 = V); a slot is `block_id * block_size + offset`. Each public function checks its
arguments (`KernelArgumentError`, a ValueError), then runs the Triton kernel or the torch
path as `PDSERVE_USE_TRITON` says (see `dispatch`). `reference` holds the loop-by-loop
versions the tests compare against. triton is imported only when a kernel runs.
"""
from pdserve.kernels.attention import DecodeAttention, paged_decode_attention, paged_prefill_attention
from pdserve.kernels.block_copy import buffer_shape, gather_blocks, scatter_blocks
from pdserve.kernels.checks import KernelArgumentError
from pdserve.kernels.kv_store import store_kv

__all__ = [
    "DecodeAttention", "KernelArgumentError", "buffer_shape", "gather_blocks", "paged_decode_attention",
    "paged_prefill_attention", "scatter_blocks", "store_kv",
]

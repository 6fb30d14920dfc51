"""Public wrappers: attention over the paged KV cache, for decode and for prefill."""
from __future__ import annotations

import torch

from pdserve.kernels import cpu_native, torch_paths
from pdserve.kernels.checks import (
    KernelArgumentError,
    check_attention_scalars,
    check_gqa,
    check_heads,
    check_index,
    check_kv_cache,
    check_same_device,
    require,
)
from pdserve.kernels.dispatch import use_triton


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, window: int | None = None
                           ) -> torch.Tensor:
    """One new token per sequence attends to its whole cached context.

    query `[B, num_heads, head_dim]`: sequence b's token at position `context_lens[b] - 1`
    (its own K/V already stored). block_tables `[B, max_blocks]` int32: entries at and past
    `ceil(context_len / block_size)` are never read. context_lens `[B]` int32; a 0 yields a
    zero output row (a padded batch slot). Head h reads KV head `h // (num_heads //
    num_kv_heads)`. With `window` W only positions `> pos - W` are seen. Softmax in fp32;
    returns `[B, num_heads, head_dim]` in the query's dtype.
    """
    return DecodeAttention(kv_cache, block_tables, context_lens, scale, window)(query, kv_cache)


class DecodeAttention:
    """`paged_decode_attention` for one step's batch over every layer: the block tables,
    context lengths and scalars are checked, and the path chosen, once; each layer's call
    then checks only its query and cache against them, not the same tables once a layer."""

    __slots__ = ("cache", "cache_shape", "cache_dtype", "device", "block_tables", "context_lens", "scale",
                 "window", "_native", "_triton")

    def __init__(self, kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 scale: float, window: int | None = None) -> None:
        self.cache = cache = check_kv_cache(kv_cache)
        num_seqs = context_lens.shape[0] if isinstance(context_lens, torch.Tensor) else -1
        check_index(block_tables, "block_tables", torch.int32, (num_seqs, None))
        check_index(context_lens, "context_lens", torch.int32, (num_seqs,))
        check_attention_scalars(scale, window)
        check_same_device(kv_cache=kv_cache, block_tables=block_tables, context_lens=context_lens)
        self.cache_shape, self.cache_dtype, self.device = tuple(kv_cache.shape), kv_cache.dtype, kv_cache.device
        self.scale, self.window = float(scale), window
        self._triton = use_triton(kv_cache.device)
        self._native = None
        if not self._triton:
            _check_context_lens(context_lens, block_tables, cache.block_size)
            if kv_cache.device.type == "cpu":
                self._native = cpu_native.decode_attention_op()
            block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
        self.block_tables, self.context_lens = block_tables, context_lens

    def __call__(self, query: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """query `[B, num_heads, head_dim]` over `kv_cache`, a layer's cache of the planned shape."""
        if not isinstance(kv_cache, torch.Tensor) or tuple(kv_cache.shape) != self.cache_shape \
                or kv_cache.dtype != self.cache_dtype or kv_cache.device != self.device \
                or not kv_cache.is_contiguous():
            raise KernelArgumentError(f"kv_cache must be a contiguous {self.cache_shape} {self.cache_dtype} on "
                                      f"{self.device}, the cache the attention was planned for")
        check_gqa(check_heads(query, "query", self.cache, self.cache_dtype), self.cache)
        if query.shape[0] != self.context_lens.shape[0]:
            raise KernelArgumentError(f"query has {query.shape[0]} sequences, context_lens {self.context_lens.shape[0]}")
        check_same_device(query=query, kv_cache=kv_cache)
        if self._triton:
            from pdserve.kernels import triton_attention

            return triton_attention.paged_decode_attention(query, kv_cache, self.block_tables, self.context_lens,
                                                           self.scale, self.window)
        if self._native is not None:
            out = self._native((query.float() * self.scale).contiguous(), kv_cache, self.block_tables,
                               self.context_lens, 0 if self.window is None else int(self.window))
            return out.to(query.dtype)
        return torch_paths.paged_decode_attention(query, kv_cache, self.block_tables, self.context_lens,
                                                  self.scale, self.window)


def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            window: int | None = None, max_query_len: int | None = None) -> torch.Tensor:
    """Causal attention of a packed chunk of new tokens over the cache (prefix + chunk).

    query `[T, num_heads, head_dim]`: sequence b's queries are rows
    `query_start_loc[b]:query_start_loc[b + 1]` (int32 `[B + 1]`, starting at 0, ending at T).
    context_lens `[B]` int32 counts the sequence's tokens in the cache including this chunk,
    whose K/V `store_kv` already wrote; query i of a chunk of q_len sits at position
    `context_len - q_len + i` and sees keys at positions `<= its own` (and `> pos - window`).
    `max_query_len`, when the caller knows it, saves the Triton path a device->host read.
    Returns `[T, num_heads, head_dim]` in the query's dtype.
    """
    cache = check_kv_cache(kv_cache)
    num_heads = check_heads(query, "query", cache, kv_cache.dtype)
    check_gqa(num_heads, cache)
    num_seqs = context_lens.shape[0] if isinstance(context_lens, torch.Tensor) else -1
    check_index(context_lens, "context_lens", torch.int32, (None,))
    check_index(query_start_loc, "query_start_loc", torch.int32, (num_seqs + 1,))
    check_index(block_tables, "block_tables", torch.int32, (num_seqs, None))
    check_attention_scalars(scale, window)
    require(max_query_len is None or (isinstance(max_query_len, int) and max_query_len >= 0),
            f"max_query_len must be None or an int >= 0, got {max_query_len!r}")
    check_same_device(query=query, kv_cache=kv_cache, block_tables=block_tables,
                      query_start_loc=query_start_loc, context_lens=context_lens)
    if use_triton(kv_cache.device):
        from pdserve.kernels import triton_attention

        return triton_attention.paged_prefill_attention(query, kv_cache, block_tables, query_start_loc,
                                                        context_lens, float(scale), window, max_query_len)
    _check_context_lens(context_lens, block_tables, cache.block_size)
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    require(int(starts[0]) == 0 and int(starts[-1]) == query.shape[0] and bool((q_lens >= 0).all()),
            f"query_start_loc must rise from 0 to {query.shape[0]} (the query rows)")
    require(bool((q_lens <= context_lens.long()).all()), "a chunk is longer than its context_len")
    return torch_paths.paged_prefill_attention(query, kv_cache, block_tables, query_start_loc, context_lens,
                                               float(scale), window)


def _check_context_lens(context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> None:
    """Data checks, on the torch path only (on CUDA they would synchronise the stream)."""
    if context_lens.numel():
        capacity = block_tables.shape[1] * block_size
        require(int(context_lens.min()) >= 0 and int(context_lens.max()) <= capacity,
                f"context_lens must lie in [0, {capacity}] (block_tables width x block_size)")

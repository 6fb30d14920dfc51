"""Fast pure-torch paths: what the wrappers run on CPU (and on CUDA without triton).

Same contracts as `reference.py`, written as a few batched tensor ops instead of loops.
The decode path is on every CPU decode step (every layer), so it avoids per-sequence
Python work: one gather of each sequence's blocks into a padded batch, two batched
matmuls, one masked softmax.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from pdserve.kernels.checks import require

# Up to this many KV heads the decode path multiplies against all heads at once with a
# block-diagonal query (num_kv_heads x the flops, no copy of K/V into head-major order);
# above it, a head-major copy of K/V is cheaper than the wasted flops.
_BLOCK_DIAGONAL_MAX_KV_HEADS = 4
# Gathered K/V (fp32) per decode pass: small enough to stay in cache until the matmuls read
# it back (the best of 0.5-8 MiB at SmolLM2's shape).
_GATHER_BUDGET_BYTES = 2 << 20


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    num_blocks, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    slots = slot_mapping
    if slots.numel() == 0:
        return
    require(int(slots.min()) >= -1 and int(slots.max()) < num_blocks * block_size,
            f"slot_mapping holds slots outside [-1, {num_blocks * block_size})")
    keep = slots >= 0
    if not bool(keep.all()):  # drop padding tokens (slot -1)
        slots, key, value = slots[keep], key[keep], value[keep]
    # Row r of the flat view is kv_cache[r // (2 bs), (r // bs) % 2, r % bs]: the K row of
    # slot (block, offset) is block * 2 bs + offset, its V row bs further on.
    rows = slots // block_size * (2 * block_size) + slots % block_size
    flat = kv_cache.view(num_blocks * 2 * block_size, num_kv_heads, head_dim)
    flat.index_copy_(0, rows, key)
    flat.index_copy_(0, rows + block_size, value)


def gather_contexts(kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                    first_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sequence's blocks from the one holding position `first_positions[b]` to the one
    holding its last token (`context_lens[b] - 1`), padded to a common count of blocks.

    Returns keys and values `[B, L, num_kv_heads, head_dim]` (cache dtype) and the absolute
    position of each of the L columns, `[B, L]`. Padding columns read block 0 as filler and
    must be masked by position. Table entries past `ceil(context_len / block_size)` are
    never read.
    """
    block_size = kv_cache.shape[2]
    first_block = first_positions // block_size
    end_block = (context_lens + block_size - 1) // block_size  # one past the last block used
    num_cols = int((end_block - first_block).max()) if context_lens.numel() else 0
    cols = first_block[:, None] + torch.arange(num_cols, device=kv_cache.device)  # table columns
    in_use = cols < end_block[:, None]
    table = block_tables.gather(1, torch.where(in_use, cols, 0)) if num_cols else cols
    block_ids = torch.where(in_use, table.long(), 0).flatten()
    shape = (context_lens.shape[0], num_cols * block_size) + tuple(kv_cache.shape[3:])
    keys = kv_cache[:, 0].index_select(0, block_ids).view(shape)
    values = kv_cache[:, 1].index_select(0, block_ids).view(shape)
    positions = (first_block * block_size)[:, None] + torch.arange(shape[1], device=kv_cache.device)
    return keys, values, positions


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, window: int | None = None
                           ) -> torch.Tensor:
    """Gathers and attends a few sequences at a time: each pass's gathered K/V (about
    `_GATHER_BUDGET_BYTES`) is still in cache when the matmuls read it back, which on CPU
    beats gathering the whole batch first by ~1.3-1.5x (SmolLM2's shape, cold caches)."""
    num_seqs, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    lens = context_lens.long()
    # The query sits at lens - 1 and sees positions > lens - 1 - window.
    first = torch.zeros_like(lens) if window is None else (lens - window).clamp(min=0)
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    longest = int((lens - first).max()) + block_size  # keys per sequence, rounded out to blocks
    seqs_per_pass = max(1, _GATHER_BUDGET_BYTES // (longest * num_kv_heads * head_dim * 2 * 4))
    q = query.float() * scale
    for start in range(0, num_seqs, seqs_per_pass):
        rows = slice(start, start + seqs_per_pass)
        keys, values, positions = gather_contexts(kv_cache, block_tables[rows], lens[rows], first[rows])
        hidden = (positions < first[rows, None]) | (positions >= lens[rows, None])  # [b, L]
        attend = _attend_block_diagonal if num_kv_heads <= _BLOCK_DIAGONAL_MAX_KV_HEADS else _attend_head_major
        out[rows] = attend(q[rows], keys.float(), values.float(), hidden).to(query.dtype)
    return out.masked_fill_((lens == 0)[:, None, None], 0.0)  # an empty context attends to nothing


def _attend_block_diagonal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor
                           ) -> torch.Tensor:
    """q `[B, H, D]`, keys/values `[B, L, kvh, D]` -> `[B, H, D]`, with no copy of K/V.

    q_wide[b, k*G + g, k'*D + d] = q[b, k*G + g, d] if k == k' else 0, so one bmm against the
    keys viewed `[B, L, kvh*D]` gives each head's scores against its own KV head only.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_keys, num_kv_heads = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    q_wide = q.new_zeros(num_seqs, num_kv_heads, group, num_kv_heads, head_dim)
    q_wide.diagonal(dim1=1, dim2=3).copy_(q.view(num_seqs, num_kv_heads, group, head_dim).permute(0, 2, 3, 1))
    width = num_kv_heads * head_dim
    scores = torch.bmm(q_wide.view(num_seqs, num_heads, width), keys.view(num_seqs, num_keys, width).transpose(1, 2))
    scores.masked_fill_(hidden[:, None, :], float("-inf"))  # [B, H, L]
    wide = torch.bmm(torch.softmax(scores, dim=-1), values.view(num_seqs, num_keys, width))  # [B, H, kvh*D]
    # wide[b, k*G + g, k'*D + d]: keep the k == k' blocks.
    out = wide.view(num_seqs, num_kv_heads, group, num_kv_heads, head_dim).diagonal(dim1=1, dim2=3)
    return out.permute(0, 3, 1, 2).reshape(num_seqs, num_heads, head_dim)


def _attend_head_major(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor
                       ) -> torch.Tensor:
    """Same contract as `_attend_block_diagonal`, via a head-major copy of K/V."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    keys = keys.transpose(1, 2).contiguous()  # [B, kvh, L, D]
    values = values.transpose(1, 2).contiguous()
    scores = torch.matmul(q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim), keys.transpose(2, 3))
    scores.masked_fill_(hidden[:, None, None, :], float("-inf"))  # [B, kvh, G, L]
    return torch.matmul(torch.softmax(scores, dim=-1), values).reshape(num_seqs, num_heads, head_dim)


def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            window: int | None = None) -> torch.Tensor:
    """One SDPA per sequence over its gathered blocks, with a causal mask offset by the
    cached prefix (and a window)."""
    block_size = kv_cache.shape[2]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        start, end = starts[seq], starts[seq + 1]
        if end == start:
            continue
        cached = context_len - (end - start)  # query i sits at position cached + i
        first = 0 if window is None else max(0, cached - window + 1)  # earliest key any query sees
        first_block, end_block = first // block_size, -(-context_len // block_size)
        block_ids = block_tables[seq, first_block:end_block].long()
        skip = first - first_block * block_size  # keys before `first` in its block
        keys, values = (kv_cache[:, kv].index_select(0, block_ids).flatten(0, 1)[skip:skip + context_len - first]
                        .transpose(0, 1) for kv in (0, 1))  # [kvh, keys, D]
        q = query[start:end].transpose(0, 1)  # [H, q_len, D]
        if window is None and cached == 0:
            mask = None  # square causal: SDPA's own (top-left aligned) mask is right
        else:
            q_pos = cached + torch.arange(end - start, device=query.device)[:, None]
            k_pos = first + torch.arange(context_len - first, device=query.device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
        out[start:end] = _sdpa_gqa(q, keys, values, mask, mask is None, scale).transpose(0, 1)
    return out


def _sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              causal: bool, scale: float) -> torch.Tensor:
    """SDPA of `[H, Q, D]` queries over `[kvh, N, D]` keys/values, kv head = h // (H / kvh)."""
    group = q.shape[0] // k.shape[0]
    if group > 1 and not _SDPA_HAS_GQA:
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    extra = {"enable_gqa": True} if group > 1 and _SDPA_HAS_GQA else {}
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=causal,
                                          scale=scale, **extra)[0]


_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def gather_blocks(kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    for layer_idx, layer in enumerate(kv_caches):
        torch.index_select(layer, 0, block_ids, out=out[:, layer_idx])
    return out


def scatter_blocks(buffer: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor) -> None:
    for layer_idx, layer in enumerate(kv_caches):
        layer.index_copy_(0, block_ids, buffer[:, layer_idx])

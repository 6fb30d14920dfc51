"""Pure-torch references: slow, loop-by-loop, obviously correct. Tests compare every other
implementation against these; nothing on a serving path calls them.

Layout (one layer): `kv_cache[block, 0 | 1, offset, kv_head, :]` holds the K | V of the token
in slot `block * block_size + offset`. A sequence's token at absolute position `p` lives in
block `block_table[p // block_size]` at offset `p % block_size`.
"""
from __future__ import annotations

from typing import Sequence

import torch


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    block_size = kv_cache.shape[2]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot == -1:  # padding token
            continue
        block, offset = divmod(slot, block_size)
        kv_cache[block, 0, offset] = key[token]
        kv_cache[block, 1, offset] = value[token]


def sequence_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, context_len: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first `context_len` tokens, `[context_len, kv_heads, head_dim]`
    each, in fp32. Reads only the table entries the context covers."""
    block_size = kv_cache.shape[2]
    keys, values = [], []
    for position in range(context_len):
        block = int(block_table[position // block_size])
        keys.append(kv_cache[block, 0, position % block_size])
        values.append(kv_cache[block, 1, position % block_size])
    if not keys:
        empty = kv_cache.new_zeros((0,) + tuple(kv_cache.shape[3:]), dtype=torch.float32)
        return empty, empty
    return torch.stack(keys).float(), torch.stack(values).float()


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of one query vector `[D]` over `keys`/`values` `[N, D]`, in fp32."""
    if keys.shape[0] == 0:
        return torch.zeros_like(query, dtype=torch.float32)
    scores = (keys @ query.float()) * scale
    return torch.softmax(scores, dim=0) @ values


def first_visible(position: int, window: int | None) -> int:
    """The earliest key position a query at `position` sees: all of them, or the last `window`."""
    return 0 if window is None else max(0, position - window + 1)


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, window: int | None = None
                           ) -> torch.Tensor:
    num_seqs, num_heads, _ = query.shape
    group = num_heads // kv_cache.shape[3]
    out = torch.zeros_like(query)
    for seq in range(num_seqs):
        context_len = int(context_lens[seq])
        keys, values = sequence_kv(kv_cache, block_tables[seq], context_len)
        lo = first_visible(context_len - 1, window)  # the query sits at context_len - 1
        for head in range(num_heads):
            kv_head = head // group
            out[seq, head] = attend(query[seq, head], keys[lo:, kv_head], values[lo:, kv_head], scale)
    return out


def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            window: int | None = None) -> torch.Tensor:
    num_heads = query.shape[1]
    group = num_heads // kv_cache.shape[3]
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        keys, values = sequence_kv(kv_cache, block_tables[seq], context_len)
        q_len = starts[seq + 1] - starts[seq]
        cached = context_len - q_len  # tokens before this chunk
        for i in range(q_len):
            position = cached + i
            lo = first_visible(position, window)
            for head in range(num_heads):
                kv_head = head // group
                out[starts[seq] + i, head] = attend(
                    query[starts[seq] + i, head], keys[lo:position + 1, kv_head],
                    values[lo:position + 1, kv_head], scale)
    return out


def gather_blocks(kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
    """`[N, num_layers, 2, block_size, kv_heads, head_dim]`: block n's data, layer by layer."""
    blocks = [torch.stack([layer[block] for layer in kv_caches]) for block in block_ids.tolist()]
    if not blocks:
        return kv_caches[0].new_empty((0, len(kv_caches)) + tuple(kv_caches[0].shape[1:]))
    return torch.stack(blocks)


def scatter_blocks(buffer: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor) -> None:
    for n, block in enumerate(block_ids.tolist()):
        for layer_idx, layer in enumerate(kv_caches):
            layer[block] = buffer[n, layer_idx]

"""Random paged-cache inputs for the kernel tests and the kernel benchmark.

Sequences get their blocks from a shuffled pool (so they interleave in the cache, as after
some serving), and every block-table entry past a sequence's last block holds an id far
outside the cache: a kernel that reads one fails loudly instead of reading stale data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

GARBAGE_BLOCK_ID = 2**30


@dataclass(frozen=True, slots=True)
class PagedBatch:
    kv_cache: torch.Tensor      # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32


def random_paged_batch(context_lens: Sequence[int], num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                       spare_blocks: int = 3, spare_columns: int = 2, seed: int = 0) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_needed) + spare_blocks
    max_blocks = max(blocks_needed, default=0) + spare_columns
    pool = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(context_lens), max_blocks), GARBAGE_BLOCK_ID, dtype=torch.int32)
    taken = 0
    for seq, need in enumerate(blocks_needed):
        tables[seq, :need] = pool[taken:taken + need]
        taken += need
    device = torch.device(device)
    cache_gen = gen if device.type == "cpu" else torch.Generator(device=device).manual_seed(seed)
    kv_cache = torch.randn((num_blocks, 2, block_size, num_kv_heads, head_dim), generator=cache_gen,
                           device=device).to(dtype)  # drawn where it lives: the benchmark's is GBs
    return PagedBatch(kv_cache, tables.to(device),
                      torch.tensor(list(context_lens), dtype=torch.int32, device=device))


def random_queries(num_rows: int, num_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((num_rows, num_heads, head_dim), generator=gen).to(device=device, dtype=dtype)


def query_start_loc(query_lens: Sequence[int], device: str | torch.device = "cpu") -> torch.Tensor:
    """`[B + 1]` int32 prefix sums: sequence b's queries are rows [loc[b], loc[b + 1])."""
    locs = [0]
    for n in query_lens:
        locs.append(locs[-1] + n)
    return torch.tensor(locs, dtype=torch.int32, device=device)

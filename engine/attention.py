"""Per-step attention metadata, built once by the model runner and read by every layer.

The step's tokens are packed: first every decoding sequence (one token each), then every
prefill chunk. Decode rows [0, num_decode_tokens) use paged decode attention; the rest use
paged prefill attention (a chunk attends to its cached prefix and to itself, causally).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token (-1 = none)
    num_decode_tokens: int  # decode rows; each attends to its sequence's positions up to its own
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32, incl. the new token
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, offsets into prefill rows
    prefill_context_lens: torch.Tensor  # [num_prefills] int32, cached prefix + chunk
    window: int | None = None

    @property
    def num_prefills(self) -> int:
        return int(self.prefill_context_lens.shape[0])

"""Triton kernel of `digest.payload_digest` (NH-16, Toeplitz lanes). Imported lazily.

One program per chunk of PAIRS 32-bit words: one coalesced load of the chunk, then each lane
adds its shifted key and multiplies the halves in 32 bits, and sums in int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.digest import KEY_PAIRS, LANES, PAIRS, num_chunks


@triton.jit
def _nh16_kernel(
    words_ptr,   # [num_words] int32, the payload
    key_ptr,     # [2, KEY_PAIRS] int64
    out_ptr,     # [num_chunks, LANES] int64
    num_words,
    KEY_PAIRS: tl.constexpr,
    PAIRS: tl.constexpr,
    LANES: tl.constexpr,
):
    chunk = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, PAIRS)
    index = chunk * PAIRS + offs
    word = tl.load(words_ptr + index, mask=index < num_words, other=0)
    lo = word & 0xFFFF
    hi = (word >> 16) & 0xFFFF  # an arithmetic shift: mask the sign off
    for lane in tl.static_range(LANES):
        key_lo = tl.load(key_ptr + lane + offs).to(tl.int32)
        key_hi = tl.load(key_ptr + KEY_PAIRS + lane + offs).to(tl.int32)
        # each factor < 2^16: the product fits 32 unsigned bits, the sum needs 64
        prod = ((lo + key_lo) & 0xFFFF).to(tl.uint32) * ((hi + key_hi) & 0xFFFF).to(tl.uint32)
        tl.store(out_ptr + chunk * LANES + lane, tl.sum(prod.to(tl.int64), axis=0))


def payload_digest(words: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    chunks = num_chunks(4 * words.numel())
    out = torch.empty((chunks, LANES), dtype=torch.int64, device=words.device)
    if chunks:
        _nh16_kernel[(chunks,)](words, key, out, words.numel(), KEY_PAIRS=KEY_PAIRS, PAIRS=PAIRS,
                                LANES=LANES, num_warps=8)
    return out

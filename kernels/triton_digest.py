"""Triton kernel of `digest.payload_digest` (NH-16, Toeplitz lanes). Imported lazily.

Program (t, g) takes TILE word positions of every chunk in group g: it loads its slice of the
key for all LANES lanes once (`[LANES, TILE]`, kept in registers), then for each chunk of the
group reads TILE words (one coalesced load), adds the keys and multiplies the halves in 32
bits, and sums each lane (int32 sums of the products' 16-bit halves, joined in int64). The PAIRS // TILE partial sums of a chunk are added by
torch afterwards (exact: integer sums). Reading the key once per group instead of once per
chunk is what makes it run near memory speed: per chunk the key is 4x the payload's bytes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.digest import KEY_PAIRS, LANES, PAIRS, num_chunks

TILE = 512  # word positions per program
GROUP = 16  # chunks per program


@triton.jit
def _nh16_kernel(
    words_ptr,   # [num_words] int32, the payload
    key_ptr,     # [2, KEY_PAIRS] int32
    out_ptr,     # [num_chunks, PAIRS // TILE, LANES] int64: partial sums
    num_words,
    num_chunks,
    KEY_PAIRS: tl.constexpr,
    PAIRS: tl.constexpr,
    LANES: tl.constexpr,
    TILE: tl.constexpr,
    GROUP: tl.constexpr,
):
    tile = tl.program_id(0)
    group = tl.program_id(1).to(tl.int64)
    offs = tile * TILE + tl.arange(0, TILE)
    lanes = tl.arange(0, LANES)
    key_at = lanes[:, None] + offs[None, :]  # lane j reads the key shifted by j
    key_lo = tl.load(key_ptr + key_at)
    key_hi = tl.load(key_ptr + KEY_PAIRS + key_at)
    for i in range(GROUP):
        chunk = group * GROUP + i
        index = chunk * PAIRS + offs
        word = tl.load(words_ptr + index, mask=index < num_words, other=0)
        lo = word & 0xFFFF
        hi = (word >> 16) & 0xFFFF  # an arithmetic shift: mask the sign off
        # each factor < 2^16: the product fits 32 unsigned bits; its two 16-bit halves are
        # summed apart in int32 (TILE of them < 2^25) and joined in int64 once per lane
        prod = ((lo[None, :] + key_lo) & 0xFFFF).to(tl.uint32) * ((hi[None, :] + key_hi) & 0xFFFF).to(tl.uint32)
        low = tl.sum((prod & 0xFFFF).to(tl.int32), axis=1)
        high = tl.sum((prod >> 16).to(tl.int32), axis=1)
        sums = high.to(tl.int64) * 65536 + low.to(tl.int64)
        tl.store(out_ptr + (chunk * (PAIRS // TILE) + tile) * LANES + lanes, sums,
                 mask=lanes + chunk * LANES < num_chunks * LANES)


def payload_digest(words: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    chunks = num_chunks(4 * words.numel())
    partial = torch.empty((chunks, PAIRS // TILE, LANES), dtype=torch.int64, device=words.device)
    if chunks:
        grid = (PAIRS // TILE, triton.cdiv(chunks, GROUP))
        _nh16_kernel[grid](words, key.to(torch.int32), partial, words.numel(), chunks, KEY_PAIRS=KEY_PAIRS,
                           PAIRS=PAIRS, LANES=LANES, TILE=TILE, GROUP=GROUP, num_warps=4)
    return partial.sum(dim=1)

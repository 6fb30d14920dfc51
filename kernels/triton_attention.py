"""Triton kernels: attention over the paged KV cache (decode and prefill). Imported lazily.

Cache addressing, shared by both kernels: token position `p` of sequence `b` lives in block
`block_tables[b, p // BLOCK_SIZE]`; with `TOKEN = KVH * HEAD_DIM`, its K row for kv head
`k` starts at element `((block * 2 + 0) * BLOCK_SIZE + p % BLOCK_SIZE) * TOKEN + k * HEAD_DIM`
and its V row `BLOCK_SIZE * TOKEN` elements later. Only table entries below
`ceil(context_len / BLOCK_SIZE)` are read.

Softmax runs online in the log2 domain (scores pre-multiplied by `scale * log2(e)`), in fp32.
The running max starts at a large finite negative number rather than -inf, so a tile whose
keys are all masked leaves the state unchanged instead of producing NaN.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from pdserve.kernels.dispatch import interpreting

_LOG2E = 1.4426950408889634
_NEG_INIT = tl.constexpr(-1.0e30)


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    # FP32: exact fp32 products. Used for fp32 caches, and always under the interpreter,
    # whose tl.dot mishandles bf16 operands.
    if FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _decode_kernel(
    query_ptr,         # [B, H, D], strides (stride_qb, stride_qh, 1)
    kv_cache_ptr,      # [num_blocks, 2, BLOCK_SIZE, KVH, D] contiguous
    block_tables_ptr,  # [B, max_blocks] int32, row stride stride_bt
    context_lens_ptr,  # [B] int32, tokens in the cache incl. the query's own
    out_ptr,           # [B, H, D] contiguous; written when NUM_SPLITS == 1
    part_acc_ptr,      # [B, H, NUM_SPLITS, D] fp32: sum of p * v over the split (unnormalised)
    part_max_ptr,      # [B, H, NUM_SPLITS] fp32: max log2-score over the split
    part_sum_ptr,      # [B, H, NUM_SPLITS] fp32: sum of p over the split
    stride_qb, stride_qh, stride_bt,
    scale_log2,
    window,
    NUM_HEADS: tl.constexpr, KVH: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr,
):
    # One program: one sequence, one KV head with all GROUP query heads that share it (K/V
    # read once per group), one of NUM_SPLITS runs of the visible context.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    if HAS_WINDOW:
        lo = tl.maximum(context_len - window, 0)  # the query at context_len - 1 sees > pos - window
    else:
        lo = context_len * 0
    tiles_per_split = tl.cdiv(tl.cdiv(context_len - lo, TILE_N), NUM_SPLITS)
    start = lo + split * tiles_per_split * TILE_N
    end = tl.minimum(start + tiles_per_split * TILE_N, context_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(query_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([GROUP_PAD], _NEG_INIT, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(start, end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        valid = pos < end
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        k_row = (block * 2 * BLOCK_SIZE + pos % BLOCK_SIZE) * (KVH * HEAD_DIM) + kv_head * HEAD_DIM
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(kv_cache_ptr + k_row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [TILE_N, D]
        s = _dot(q, tl.trans(k), DOT_FP32) * scale_log2  # [GROUP_PAD, TILE_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(kv_cache_ptr + k_row[:, None] + BLOCK_SIZE * KVH * HEAD_DIM + d[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
        m_i = m_new

    row = seq.to(tl.int64) * NUM_HEADS + heads  # flat (seq, head) index
    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # empty context -> zeros
        tl.store(out_ptr + row[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=out_mask)
    else:
        part = row * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
        tl.store(part_max_ptr + part, m_i, mask=g_mask)
        tl.store(part_sum_ptr + part, l_i, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_acc_ptr,  # [B * H, NUM_SPLITS, D] fp32
    part_max_ptr,  # [B * H, NUM_SPLITS] fp32
    part_sum_ptr,  # [B * H, NUM_SPLITS] fp32
    out_ptr,       # [B * H, D] contiguous
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    # One program per (seq, head): rescale each split's partial sums to the common max.
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = s < NUM_SPLITS
    d_mask = d < HEAD_DIM
    maxes = tl.load(part_max_ptr + row * NUM_SPLITS + s, mask=s_mask, other=_NEG_INIT)
    sums = tl.load(part_sum_ptr + row * NUM_SPLITS + s, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + (row * NUM_SPLITS + s[:, None]) * HEAD_DIM + d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    w = tl.exp2(maxes - tl.max(maxes, 0))  # empty splits: max -1e30, sum 0 -> weight x sum = 0
    total = tl.sum(w * sums, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _prefill_kernel(
    query_ptr,            # [T, H, D], strides (stride_qt, stride_qh, 1)
    kv_cache_ptr,         # [num_blocks, 2, BLOCK_SIZE, KVH, D] contiguous
    block_tables_ptr,     # [B, max_blocks] int32, row stride stride_bt
    query_start_loc_ptr,  # [B + 1] int32: seq b's queries are rows [qsl[b], qsl[b + 1])
    context_lens_ptr,     # [B] int32: cached prefix + this chunk
    out_ptr,              # [T, H, D] contiguous
    stride_qt, stride_qh, stride_bt,
    scale_log2,
    window,
    NUM_HEADS: tl.constexpr, KVH: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr,
):
    # One program: BLOCK_M queries of one sequence, one query head.
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    cached = context_len - q_len  # query i sits at absolute position cached + i
    kv_head = head // GROUP

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM_PAD)
    m_mask = m < q_len
    d_mask = d < HEAD_DIM
    q_pos = cached + m
    q_rows = (q_start + m).to(tl.int64)
    q = tl.load(query_ptr + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    # Keys any row of this tile may see: [lo, hi).
    hi = tl.minimum(cached + (tile + 1) * BLOCK_M, context_len)
    if HAS_WINDOW:
        lo = tl.maximum(cached + tile * BLOCK_M - window + 1, 0)
    else:
        lo = hi * 0
    m_i = tl.full([BLOCK_M], _NEG_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n_start in range(lo, hi, BLOCK_N):
        k_pos = n_start + tl.arange(0, BLOCK_N)
        k_valid = k_pos < hi
        block = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        k_row = (block * 2 * BLOCK_SIZE + k_pos % BLOCK_SIZE) * (KVH * HEAD_DIM) + kv_head * HEAD_DIM
        kv_mask = k_valid[:, None] & d_mask[None, :]
        k = tl.load(kv_cache_ptr + k_row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D]
        s = _dot(q, tl.trans(k), DOT_FP32) * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(kv_cache_ptr + k_row[:, None] + BLOCK_SIZE * KVH * HEAD_DIM + d[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_rows[:, None] * NUM_HEADS + head) * HEAD_DIM + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@functools.cache
def _num_programs_target(device: torch.device) -> int:
    """How many programs keep the device busy: a few waves per SM on CUDA."""
    if device.type == "cuda":
        return 8 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_tokens: int, tile_n: int,
                      device: torch.device) -> int:
    """Split the context when (sequence, kv head) pairs alone cannot fill the device; a power
    of two (fewer distinct compilations), at most one split per tile, at most 64."""
    wanted = triton.cdiv(_num_programs_target(device), max(num_seqs * num_kv_heads, 1))
    wanted = min(wanted, triton.cdiv(max(max_tokens, 1), tile_n), 64)
    return 1 << (max(wanted, 1).bit_length() - 1)


def _tile_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """(tokens per tile, warps). Chosen so that nothing spills on sm_90 (ptxas -v on the
    kernels compiled ahead of time, head dims 64/128); not yet tuned on a GPU. fp32 tiles
    are halved: their operands take twice the registers and shared memory."""
    if dtype == torch.float32:
        return 32, 8
    return 64, (8 if head_dim > 64 else 4)


def _head_dim_pad(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot wants every dim >= 16


def _dot_fp32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or interpreting()


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, window: int | None = None,
                           num_splits: int | None = None) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    tile_n, num_warps = _tile_config(head_dim, kv_cache.dtype)
    max_tokens = block_tables.shape[1] * block_size
    if window is not None:
        max_tokens = min(max_tokens, window)
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_tokens, tile_n, query.device)
    if num_splits > 1:
        part_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                               device=query.device)
        part_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused
    head_dim_pad = _head_dim_pad(head_dim)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, kv_cache, block_tables, context_lens, out, part_acc, part_max, part_sum,
        query.stride(0), query.stride(1), block_tables.stride(0),
        scale * _LOG2E, window or 0,
        NUM_HEADS=num_heads, KVH=num_kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        TILE_N=tile_n, NUM_SPLITS=num_splits, HAS_WINDOW=window is not None,
        DOT_FP32=_dot_fp32(kv_cache.dtype), num_warps=num_warps)
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs * num_heads,)](
            part_acc, part_max, part_sum, out,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=1)
    return out


def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            window: int | None = None, max_query_len: int | None = None) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = context_lens.shape[0]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:  # one small device->host read; pass it to avoid the sync
        max_query_len = num_tokens if num_seqs == 1 else int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_m, num_warps = _tile_config(head_dim, kv_cache.dtype)
    block_n = block_m
    _prefill_kernel[(math.ceil(max(max_query_len, 1) / block_m), num_seqs, num_heads)](
        query, kv_cache, block_tables, query_start_loc, context_lens, out,
        query.stride(0), query.stride(1), block_tables.stride(0),
        scale * _LOG2E, window or 0,
        NUM_HEADS=num_heads, KVH=num_kv_heads, GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=_head_dim_pad(head_dim), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_WINDOW=window is not None,
        DOT_FP32=_dot_fp32(kv_cache.dtype), num_warps=num_warps)
    return out

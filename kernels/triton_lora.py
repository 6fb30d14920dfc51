"""Triton kernels for `kernels.lora.add_lora`: a shrink then one expand per output slice,
one program per (token row, block of columns), each row reading its own adapter's matrices
through `slots` (-1: every load and store of the program is masked off). Imported lazily.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(
    x_ptr,      # [T, IN], row stride stride_x
    a_ptr,      # [S, K, IN] contiguous
    v_ptr,      # [T, K] contiguous, float32
    slots_ptr,  # [T] int32, -1 = no adapter
    stride_x,
    IN,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_IN: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    in_limit = tl.where(slot >= 0, IN, 0)  # no adapter: nothing is read
    slot = tl.maximum(slot, 0)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for start in range(0, IN, BLOCK_IN):
        cols = start + tl.arange(0, BLOCK_IN)
        xs = tl.load(x_ptr + t * stride_x + cols, mask=cols < in_limit, other=0.0).to(tl.float32)
        mask = (ks[:, None] < K) & (cols[None, :] < in_limit)
        w = tl.load(a_ptr + (slot * K + ks[:, None]) * IN + cols[None, :], mask=mask, other=0.0)
        acc += tl.sum(w.to(tl.float32) * xs[None, :], axis=1)
    tl.store(v_ptr + t * K + ks, acc, mask=ks < K)


@triton.jit
def _expand_kernel(
    v_ptr,      # [T, K] float32 contiguous; this slice's R columns start at v_off
    b_ptr,      # [S, N, R] contiguous
    y_ptr,      # [T, *], row stride stride_y; this slice's N columns start at y_off
    slots_ptr,  # [T] int32
    stride_y,
    v_off,
    y_off,
    N,
    K: tl.constexpr,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    n_limit = tl.where(slot >= 0, N, 0)  # no adapter: nothing is read or written
    slot = tl.maximum(slot, 0)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    v = tl.load(v_ptr + t * K + v_off + rs, mask=rs < R, other=0.0)
    mask = (ns[:, None] < n_limit) & (rs[None, :] < R)
    w = tl.load(b_ptr + (slot * N + ns[:, None]) * R + rs[None, :], mask=mask, other=0.0)
    update = tl.sum(w.to(tl.float32) * v[None, :], axis=1)
    ys = y_ptr + t * stride_y + y_off + ns
    old = tl.load(ys, mask=ns < n_limit, other=0.0)
    tl.store(ys, (old.to(tl.float32) + update).to(old.dtype), mask=ns < n_limit)


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: Sequence[torch.Tensor],
             slots: torch.Tensor) -> None:
    num_rows, fan_in = x.shape
    k = a.shape[1]
    rank = k // len(bs)
    v = torch.empty(num_rows, k, dtype=torch.float32, device=x.device)
    block_k = min(64, triton.next_power_of_2(k))
    _shrink_kernel[(num_rows, triton.cdiv(k, block_k))](
        x, a, v, slots, x.stride(0), fan_in, K=k, BLOCK_K=block_k,
        BLOCK_IN=min(128, triton.next_power_of_2(fan_in)))
    off = 0
    for i, b in enumerate(bs):
        n = b.shape[1]
        block_n = min(128, triton.next_power_of_2(n))
        _expand_kernel[(num_rows, triton.cdiv(n, block_n))](
            v, b, y, slots, y.stride(0), i * rank, off, n, K=k, R=rank,
            BLOCK_R=triton.next_power_of_2(rank), BLOCK_N=block_n)
        off += n

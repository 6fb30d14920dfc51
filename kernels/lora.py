"""Public wrapper: add batched LoRA updates to a linear's output, each token row under its
own adapter (Punica / S-LoRA's gathered matrix-vector idea).

For one linear whose output stacks `len(bs)` slices (q, k, v of a fused qkv; gate, up):

    v[t]                      = x[t] @ a[slots[t]].T                # shrink: [T, N * R]
    y[t, off_i : off_i + n_i] += v[t, i*R : (i+1)*R] @ bs[i][slots[t]].T   # expand, slice i

`a` is `[S, N * R, in]` (slice i's A in rows i*R..(i+1)*R), `bs[i]` is `[S, n_i, R]` with the
adapter's scaling folded in; slot -1 marks a row with no adapter (y unchanged). Ranks under
R are zero-padded in both, so they add nothing. `groups` lists the runs of equal slot as
(slot, first row, end row), slots >= 0 only: the torch path runs two small GEMMs per run,
the Triton path one program per (row, block) reading `slots`.

On CPU in float32 the native op (`csrc/cpu_lora.cpp`, `add_lora_native`) does the same in one
call, with the B slices side by side and transposed: `bt` `[S, R, out]`, slice i's columns
holding `bs[i][s].T` (`transposed_slices`); `ranks[s]` bounds the rows of slot s it reads.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from pdserve.kernels.checks import KernelArgumentError, check_index, check_same_device
from pdserve.kernels.dispatch import use_triton


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: Sequence[torch.Tensor],
             slots: torch.Tensor, groups: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """y += the LoRA update of each row (see the module doc), in place; returns y."""
    _check(y, x, a, bs, slots)
    if not groups:
        return y
    if use_triton(y.device):
        from pdserve.kernels import triton_lora

        triton_lora.add_lora(y, x, a, bs, slots)
    else:
        _add_lora_grouped(y, x, a, bs, groups)
    return y


def add_lora_native(op, y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, ranks: torch.Tensor,
                    a: torch.Tensor, bt: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """y += each row's update through the native op `op` (`cpu_native.lora_op()`), in place;
    returns y. `bounds` are the slices' column offsets (0, n_0, n_0 + n_1, ..., out); rows
    of a slot whose rank is 0 are left alone. The op checks every argument: a bad one is a
    KernelArgumentError."""
    try:
        return op(y, x, slots, ranks, a, bt, bounds)
    except RuntimeError as e:
        raise KernelArgumentError(str(e).splitlines()[0]) from None


def transposed_slices(bs: Sequence[torch.Tensor]) -> torch.Tensor:
    """`add_lora_native`'s `bt` [S, R, out] from the slices `bs[i]` [S, n_i, R]."""
    return torch.cat([b.transpose(1, 2) for b in bs], dim=2).contiguous()


def add_lora_dense(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_full: torch.Tensor,
                   row_mask: torch.Tensor) -> torch.Tensor:
    """The same update as `add_lora` in three dense ops whatever the mix of slots, for steps
    of few rows (decode) where op count, not arithmetic, is the cost:

        y += ((x @ a.view(S * K, in).T) * row_mask) @ b_full

    `b_full` is `[S * K, out]`: slot s's slice i occupies rows s*K + i*R .. + R and only slice
    i's output columns (zeros elsewhere); `row_mask` `[T, S * K]` is 1 where a column belongs to
    the row's slot, 0 elsewhere (a row with no adapter: all 0). In place; returns y."""
    num_slots, k, fan_in = a.shape
    if b_full.shape != (num_slots * k, y.shape[1]) or row_mask.shape != (x.shape[0], num_slots * k):
        raise KernelArgumentError(f"b_full {tuple(b_full.shape)} / row_mask {tuple(row_mask.shape)} do not fit "
                                  f"a {tuple(a.shape)}, x {tuple(x.shape)} and y {tuple(y.shape)}")
    v = F.linear(x.to(a.dtype), a.view(num_slots * k, fan_in))
    v.mul_(row_mask)
    if y.dtype == b_full.dtype and y.is_contiguous():
        return y.addmm_(v, b_full)
    y += (v @ b_full).to(y.dtype)
    return y


def dense_row_mask(slots: torch.Tensor, num_slots: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """`add_lora_dense`'s row mask: [T, num_slots * k], 1 on row t's slot's k columns."""
    one_hot = torch.zeros(slots.shape[0], num_slots + 1, dtype=dtype, device=slots.device)
    one_hot.scatter_(1, (slots.long() + 1)[:, None], 1)  # column 0 takes the rows with no adapter
    return one_hot[:, 1:].repeat_interleave(k, dim=1)


def _add_lora_grouped(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: Sequence[torch.Tensor],
                      groups: Sequence[tuple[int, int, int]]) -> None:
    rank = a.shape[1] // len(bs)
    for slot, lo, hi in groups:
        v = F.linear(x[lo:hi].to(a.dtype), a[slot])
        off = 0
        for i, b in enumerate(bs):
            n = b.shape[1]
            y[lo:hi, off:off + n] += F.linear(v[:, i * rank:(i + 1) * rank], b[slot]).to(y.dtype)
            off += n


def reference_add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: Sequence[torch.Tensor],
                       slots: torch.Tensor) -> torch.Tensor:
    """Row by row, for tests: gather each row's matrices, multiply, add."""
    out = y.clone()
    rank = a.shape[1] // len(bs)
    for t in range(x.shape[0]):
        s = int(slots[t])
        if s < 0:
            continue
        v = a[s].double() @ x[t].double()
        parts = [b[s].double() @ v[i * rank:(i + 1) * rank] for i, b in enumerate(bs)]
        out[t] += torch.cat(parts).to(y.dtype)
    return out


def runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """The runs of equal slot >= 0 in `slots`: (slot, first row, end row)."""
    out: list[tuple[int, int, int]] = []
    for row, slot in enumerate(slots):
        if slot < 0:
            continue
        if out and out[-1][0] == slot and out[-1][2] == row:
            out[-1] = (slot, out[-1][1], row + 1)
        else:
            out.append((slot, row, row + 1))
    return out


def _check(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: Sequence[torch.Tensor],
           slots: torch.Tensor) -> None:
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise KernelArgumentError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must be [T, in] and [T, out]")
    if a.dim() != 3 or a.shape[2] != x.shape[1] or not bs or a.shape[1] % len(bs):
        raise KernelArgumentError(f"a {tuple(a.shape)} must be [S, N * R, {x.shape[1]}] for {len(bs)} slices")
    rank = a.shape[1] // len(bs)
    if any(b.dim() != 3 or b.shape[0] != a.shape[0] or b.shape[2] != rank for b in bs):
        raise KernelArgumentError(f"each b must be [{a.shape[0]}, n, {rank}]: {[tuple(b.shape) for b in bs]}")
    if sum(b.shape[1] for b in bs) != y.shape[1]:
        raise KernelArgumentError(f"the slices' widths {[b.shape[1] for b in bs]} do not sum to y's {y.shape[1]}")
    if not (a.is_contiguous() and all(b.is_contiguous() for b in bs) and x.stride(1) == 1 and y.stride(1) == 1):
        raise KernelArgumentError("a and each b must be contiguous; x and y contiguous along a row")
    check_index(slots, "slots", torch.int32, (x.shape[0],))
    check_same_device(y=y, x=x, a=a, slots=slots)

"""Compile every Triton kernel for a CUDA target without a GPU: `python -m
pdserve.kernels.triton_aot [--arch 90]`.

The interpreter (what CPU CI runs the kernels under) accepts code that the GPU compiler
rejects (tl.dot shapes under 16, dtype mismatches, over-large shared memory...). Compiling
ahead of time with triton's bundled ptxas catches those on a machine without a GPU. Run it
in a process where TRITON_INTERPRET is unset: interpreted kernels cannot be compiled.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pdserve.kernels import triton_attention as attention
from pdserve.kernels import triton_block_copy as block_copy
from pdserve.kernels import triton_digest as digest
from pdserve.kernels import triton_kv_store as kv_store

_TYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _decode(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int,
            num_splits: int, window: bool) -> tuple:
    t = "*" + _TYPE[dtype]
    tile_n, num_warps = attention._tile_config(head_dim, dtype)
    group = heads // kv_heads
    types = dict(query_ptr=t, kv_cache_ptr=t, block_tables_ptr="*i32", context_lens_ptr="*i32", out_ptr=t,
                 part_acc_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32", stride_qb="i32",
                 stride_qh="i32", stride_bt="i32", scale_log2="fp32", window="i32")
    consts = dict(NUM_HEADS=heads, KVH=kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
                  HEAD_DIM=head_dim, HEAD_DIM_PAD=attention._head_dim_pad(head_dim), BLOCK_SIZE=block_size,
                  TILE_N=tile_n, NUM_SPLITS=num_splits, HAS_WINDOW=window,
                  DOT_FP32=dtype == torch.float32)
    return attention._decode_kernel, types, consts, num_warps


def _reduce(dtype: torch.dtype, head_dim: int, num_splits: int) -> tuple:
    types = dict(part_acc_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32", out_ptr="*" + _TYPE[dtype])
    consts = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=attention._head_dim_pad(head_dim), NUM_SPLITS=num_splits,
                  SPLITS_PAD=triton.next_power_of_2(num_splits))
    return attention._decode_reduce_kernel, types, consts, 1


def _prefill(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int, window: bool) -> tuple:
    t = "*" + _TYPE[dtype]
    block_m, num_warps = attention._tile_config(head_dim, dtype)
    types = dict(query_ptr=t, kv_cache_ptr=t, block_tables_ptr="*i32", query_start_loc_ptr="*i32",
                 context_lens_ptr="*i32", out_ptr=t, stride_qt="i32", stride_qh="i32", stride_bt="i32",
                 scale_log2="fp32", window="i32")
    consts = dict(NUM_HEADS=heads, KVH=kv_heads, GROUP=heads // kv_heads, HEAD_DIM=head_dim,
                  HEAD_DIM_PAD=attention._head_dim_pad(head_dim), BLOCK_SIZE=block_size, BLOCK_M=block_m,
                  BLOCK_N=block_m, HAS_WINDOW=window, DOT_FP32=dtype == torch.float32)
    return attention._prefill_kernel, types, consts, num_warps


def _store(dtype: torch.dtype, kv_heads: int, head_dim: int, block_size: int) -> tuple:
    t = "*" + _TYPE[dtype]
    types = dict(key_ptr=t, value_ptr=t, kv_cache_ptr=t, slot_mapping_ptr="*i64", stride_key="i32",
                 stride_value="i32")
    numel = kv_heads * head_dim
    consts = dict(TOKEN_NUMEL=numel, TOKEN_PAD=triton.next_power_of_2(numel), BLOCK_SIZE=block_size)
    return kv_store._store_kv_kernel, types, consts, 4


def _copy(kernel, dtype: torch.dtype, block_numel: int) -> tuple:
    t = "*" + _TYPE[dtype]
    types = dict(cache_ptr=t, buffer_ptr=t, block_ids_ptr="*i64", layer="i32", num_layers="i32")
    consts = dict(BLOCK_NUMEL=block_numel, CHUNK=min(block_copy._CHUNK, triton.next_power_of_2(block_numel)))
    return kernel, types, consts, 4


def _digest() -> tuple:
    types = dict(words_ptr="*i32", key_ptr="*i32", out_ptr="*i64", num_words="i64", num_chunks="i64")
    consts = dict(KEY_PAIRS=digest.KEY_PAIRS, PAIRS=digest.PAIRS, LANES=digest.LANES, TILE=digest.TILE,
                  GROUP=digest.GROUP)
    return digest._nh16_kernel, types, consts, 4


def specs() -> list[tuple]:
    """(kernel, argument types, constexprs, num_warps) for the shapes pdserve serves."""
    bf16 = torch.bfloat16
    return [
        _decode(bf16, 32, 8, 128, 16, 4, False),   # Llama-8B-like, split context
        _decode(bf16, 9, 3, 64, 32, 1, True),      # SmolLM2, one split, window
        _decode(torch.float32, 8, 8, 64, 16, 2, False),
        _reduce(bf16, 128, 4),
        _prefill(bf16, 32, 8, 128, 16, False),
        _prefill(bf16, 9, 3, 64, 32, True),
        _prefill(torch.float32, 9, 3, 64, 16, False),
        _store(bf16, 8, 128, 16),
        _store(torch.float32, 3, 64, 32),
        _copy(block_copy._gather_layer_kernel, bf16, 2 * 16 * 8 * 128),
        _copy(block_copy._scatter_layer_kernel, bf16, 2 * 16 * 3 * 64),
        _digest(),
    ]


def compile_all(arch: int = 90) -> list[str]:
    """Compile every spec for sm_<arch>; returns one line per kernel. Raises on failure."""
    target = GPUTarget("cuda", arch, 32)
    lines = []
    for kernel, types, consts, num_warps in specs():
        signature = {name: ("constexpr" if name in consts else types[name]) for name in kernel.arg_names}
        start = time.perf_counter()
        compiled = triton.compile(ASTSource(kernel, signature, consts), target=target,
                                  options={"num_warps": num_warps})
        lines.append(f"{kernel.__name__}: sm_{arch} ok in {time.perf_counter() - start:.1f}s, "
                     f"shared memory {compiled.metadata.shared} B, {consts}")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.kernels.triton_aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100/H200)")
    args = parser.parse_args(argv)
    for line in compile_all(args.arch):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A GGUF file's quantized weights, served as they are (`--quantization gguf`).

A linear's weight stays in GGML's block layout (32 weights per block, one or two half-float
scales each): Q4_0, Q4_1 and Q8_0 run natively (`csrc/cpu_quant_gemm.cpp`), other types
are dequantized at load. Two activation modes:

- **exact** (`gguf`): float32 activations; each block is expanded to float32 in registers and
  accumulated in float32. The expanded weights are bit-identical to the float32 weights the
  GGUF dequantizes to (d and m are half floats, q at most 8 bits: d * q is exact in float32),
  so only the order of summation differs from the float32 model.
- **fast** (`gguf-fast`, `FastLinear`): bfloat16 activations for the 4-bit types. A few rows:
  where the CPU has AVX-512 BF16, a native kernel that expands each block to bfloat16 (d * q +
  m in float32, rounded once) and multiplies with one dot-product instruction a block and row;
  one or two rows, or without it, torch's int4 weight-pack GEMM (a Q4_1 block of 32 is one
  group: d * q + m = d * (q - 8) + (m + 8 d)). Q8_0 runs exact: in SmolLM2's file it is the output projection, whose logits
  pick the token, and in bfloat16 it took greedy agreement with float32 from 79 to 54 of 100.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch

from pdserve.kernels import cpu_native

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGML type ids
NATIVE_TYPES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
BLOCK = 32
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
MODES = ("gguf", "gguf-fast", "gguf-int8dot", "gguf-int16dot")  # the integer dots: kernels.int8_dot
INTEGER_DOT_MODES = ("gguf-int8dot", "gguf-int16dot")
FAST_TYPES = (Q4_0, Q4_1)  # what the fast mode runs in bfloat16 (see FastLinear)
GEMM_EVENT = "pdserve::quant_linear"  # the profiler's name for the native block GEMM
GEMM_ROWS = 32  # rows from which a call expands the weights and runs oneDNN's GEMM
EXPAND_BYTES = 16 << 20  # ... at most this much of them at a time, as float32
_ONEDNN = torch.backends.mkldnn.is_available()


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """W [out_features, in_features] as GGML blocks: row n is `blocks[n]`, in_features / 32
    blocks of one type."""

    blocks: torch.Tensor  # uint8 [out_features, in_features // 32 * BLOCK_BYTES[qtype]]
    qtype: int

    def __post_init__(self) -> None:
        if self.qtype not in NATIVE_TYPES:
            raise ValueError(f"GGML type {self.qtype} has no native kernel ({', '.join(NATIVE_TYPES.values())})")
        b = self.blocks
        if b.dtype != torch.uint8 or b.dim() != 2 or b.shape[1] % BLOCK_BYTES[self.qtype]:
            raise ValueError(f"blocks must be uint8 [rows, whole {NATIVE_TYPES[self.qtype]} blocks], "
                             f"got {b.dtype} {tuple(b.shape)}")

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def in_features(self) -> int:
        return self.blocks.shape[1] // BLOCK_BYTES[self.qtype] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @property
    def type_name(self) -> str:
        return NATIVE_TYPES[self.qtype]

    def dequantize(self) -> torch.Tensor:
        """The float32 weights these blocks stand for, [out_features, in_features]."""
        return cpu_native.quant_module().dequantize_rows(self.blocks, self.qtype, 0, self.out_features)

    def permute_rows(self, order: torch.Tensor) -> QuantWeight:
        return QuantWeight(self.blocks[order].contiguous(), self.qtype)

    @staticmethod
    def stack(parts: list[QuantWeight]) -> QuantWeight | None:
        """The rows of `parts` one after another (q, k, v into one projection), or None when
        they differ in type or width."""
        if len({(p.qtype, p.in_features) for p in parts}) != 1:
            return None
        return QuantWeight(torch.cat([p.blocks for p in parts]).contiguous(), parts[0].qtype)


def quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in_features] float32 -> [..., out_features], exact mode. A few rows (decode):
    the native kernel, which reads the blocks only. Prompt-sized batches are bound by
    arithmetic, not weight bytes: there the weights are expanded once per call and multiplied
    by oneDNN (1.2-1.3x faster than expanding them into MKL's GEMM at 64-512 rows)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    module = cpu_native.quant_module()
    if x2.shape[0] >= GEMM_ROWS:
        y = _expanded_linear(module, x2, weight, bias)
    else:
        y = _native_gemm(module.quant_linear, x2, weight, bias)
    return y.reshape(*lead, weight.out_features)


def _native_gemm(kernel, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if torch.autograd._profiler_enabled():  # a pybind call is invisible to the profiler: name it
        with torch.profiler.record_function(GEMM_EVENT):
            return kernel(x, weight.blocks, weight.qtype, bias)
    return kernel(x, weight.blocks, weight.qtype, bias)


def _expanded_linear(module, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None,
                     bf16: bool = False) -> torch.Tensor:
    """oneDNN's GEMM over the weights expanded to float32, at most EXPAND_BYTES of them at a
    time (an output projection in tiles of rows), into one reused buffer: a fresh one per call
    would fault its pages in every time. `bf16` (the fast mode): each tile and x rounded to
    bfloat16 for oneDNN's bfloat16 GEMM, which runs about twice float32's rate on CPUs with
    AVX-512 BF16; float32 out."""
    rows = max(1, EXPAND_BYTES // (weight.in_features * 4))
    n = weight.out_features
    scratch = _scratch(min(n, rows) * weight.in_features)
    direct = bf16 and bf16_kernel_available()  # the kernel writes bfloat16 itself
    if bf16:
        x = x.to(torch.bfloat16)
        if direct:
            scratch = scratch.view(torch.bfloat16)[:scratch.numel()]

    def tile(start: int, end: int) -> torch.Tensor:
        w = module.dequantize_rows_into(weight.blocks, weight.qtype, start,
                                        scratch[:(end - start) * weight.in_features].view(end - start, -1))
        b = None if bias is None else bias[start:end]
        if not bf16:
            return _gemm(x, w, b)
        y = _gemm(x, w if direct else w.to(torch.bfloat16), None).float()
        return y if b is None else y.add_(b)

    if n <= rows:
        return tile(0, n)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    for start in range(0, n, rows):
        end = min(n, start + rows)
        y[:, start:end] = tile(start, end)
    return y


def _gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T + bias: oneDNN where torch has it (it reorders w itself), else torch's GEMM."""
    if _ONEDNN:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    return torch.nn.functional.linear(x, w, bias)


_local = threading.local()


def _scratch(numel: int) -> torch.Tensor:
    """This thread's float32 buffer of at least `numel` elements (the engine runs on one)."""
    buffer = getattr(_local, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        buffer = _local.buffer = torch.empty(numel, dtype=torch.float32)
    return buffer[:numel]


class FastLinear:
    """The fast mode's linear over a 4-bit weight's blocks, bfloat16 activations, by row count:

    - one or two rows (decode at batch 1-2, bound by weight bytes): torch's int4 GEMM, whose
      packed layout streams faster than the native kernels expand blocks;
    - three to GEMM_ROWS - 1: the native bfloat16 kernel where the CPU has AVX-512 BF16 (the
      fastest of the three there), else the int4 GEMM;
    - prompts: the blocks expanded to bfloat16 for oneDNN's GEMM (`_expanded_linear`).

    The int4 pack needs rows a multiple of 16; without it the few-row cases run exact or
    bfloat16. `build` returns None where nothing applies (other types): that linear runs exact."""

    __slots__ = ("weight", "int4", "bf16")
    INT4_ROWS = 2  # at most this many rows take the int4 GEMM when the bfloat16 kernel exists

    def __init__(self, weight: QuantWeight, int4: Int4Pack | None, bf16: bool) -> None:
        self.weight, self.int4, self.bf16 = weight, int4, bf16

    @classmethod
    def build(cls, weight: QuantWeight) -> FastLinear | None:
        if weight.qtype not in FAST_TYPES:
            return None
        int4 = Int4Pack(weight) if weight.out_features % 16 == 0 else None  # the pack's tiles
        bf16 = bf16_kernel_available()
        return cls(weight, int4, bf16) if int4 is not None or bf16 else None

    @property
    def nbytes(self) -> int:
        """What a one-row call reads."""
        return self.weight.nbytes if self.int4 is None else self.int4.nbytes

    @property
    def out_features(self) -> int:
        return self.weight.out_features

    @property
    def in_features(self) -> int:
        return self.weight.in_features

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        rows = x2.shape[0]
        module = cpu_native.quant_module()
        if rows >= GEMM_ROWS:
            y = _expanded_linear(module, x2, self.weight, bias, bf16=True)
        elif self.int4 is not None and (rows <= self.INT4_ROWS or not self.bf16):
            y = self.int4(x2, bias)
        elif self.bf16 and rows > self.INT4_ROWS:
            y = _native_gemm(module.quant_linear_bf16, x2.to(torch.bfloat16), self.weight, bias)
        else:
            y = _native_gemm(module.quant_linear, x2, self.weight, bias)
        return y.reshape(*lead, self.weight.out_features)


def mode_linear(weight: QuantWeight, mode: str):
    """The linear a GGUF mode runs over `weight` (`__call__(x, bias)`, `nbytes`,
    `out_features`, `in_features`), or None where the exact kernel (`quant_linear`) runs it:
    the `gguf` mode, and a type the mode has no kernel for."""
    if mode not in MODES:
        raise ValueError(f"unknown GGUF mode {mode!r} ({', '.join(MODES)})")
    if mode == "gguf-fast":
        return FastLinear.build(weight)
    if mode in INTEGER_DOT_MODES:
        from pdserve.kernels.int8_dot import Int8DotLinear

        return Int8DotLinear.build(weight, mode)
    return None


@functools.cache
def bf16_kernel_available() -> bool:
    """Whether this CPU's native build has the fast mode's bfloat16 kernel (AVX-512 BF16)."""
    return bool(cpu_native.quant_module().has_bf16_gemm())


class Int4Pack:
    """A 4-bit weight packed for torch's int4 weight-only GEMM (bfloat16 activations), one
    group per GGML block (see `FastLinear`)."""

    __slots__ = ("packed", "scales_zeros", "out_features", "in_features")

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2

    def __init__(self, weight: QuantWeight) -> None:
        if weight.qtype not in FAST_TYPES:
            raise ValueError("only 4-bit blocks pack into int4")
        self.out_features, self.in_features = weight.out_features, weight.in_features
        q, d, m = _unpack_4bit(weight)
        # torch's convention: w = (q - 8) * scale + zero, per group of 32
        zero = m + 8 * d if weight.qtype == Q4_1 else torch.zeros_like(d)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        self.scales_zeros = torch.stack([d, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in_features] (a few rows: prompts take oneDNN, see `FastLinear`)."""
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, BLOCK,
                                                       self.scales_zeros).float()
        return y if bias is None else y.add_(bias)


def _unpack_4bit(weight: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K] in 0..15, d float32 [N, K/32], m float32 [N, K/32]; m = -8 d for Q4_0)."""
    n = weight.out_features
    raw = weight.blocks.view(n, -1, BLOCK_BYTES[weight.qtype])
    d = raw[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
    if weight.qtype == Q4_1:
        m = raw[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
        qs = raw[..., 4:]
    else:
        m = -8 * d
        qs = raw[..., 2:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, -1)
    return q, d, m

"""Integer dot products over a GGUF file's blocks (`--quantization gguf-int8dot`, `gguf-int16dot`).

The weights stay the file's 4- or 8-bit integers (`QuantWeight`); a linear's input is
quantized once per call to 8 bits per block of 32 (`quantize_activations`: one scale per
block, round to nearest, [-127, 127]), each block's dot product is an integer sum, and the
weight and activation scales are applied once per block (`csrc/cpu_int8_dot.cpp`). Q8_0
blocks take 16-bit activation blocks (`ACTIVATION_BITS`): in a GGUF file Q8_0 is the output
projection, whose logits pick the token, and 8-bit activations there changed greedy answers
from the first token on; 16-bit products still sum as integers (vpmaddwd). `gguf-int16dot`
takes 16-bit blocks for every type: twice the integer instructions of the 8-bit dot, the same
float work per block, and closer to float32 (`bench quantization` measures both). The
engine merges every set of matrices that read one input (q/k/v, gate/up) into one linear
(`QuantWeight.stack`), so each input is quantized once per step.

One build holds every instruction-set path (`ISAS`, lowest first): plain C, AVX2
(vpmaddubsw), AVX-VNNI and AVX-512 VNNI (vpdpbusd). The best one the CPU reports is chosen
at start and logged once; PDSERVE_CPU_ISA (`common.envs`) names a lower one instead.
Prompt-sized calls (GEMM_ROWS rows and more) are bound by arithmetic, not weight bytes:
they take the exact mode's expanded-weights GEMM, so a prompt's KV is the `gguf` mode's.
"""
from __future__ import annotations

import functools
import logging
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.kernels import cpu_native
from pdserve.kernels.quant import GEMM_EVENT, GEMM_ROWS, Q4_0, Q4_1, Q8_0, QuantWeight, _expanded_linear

log = logging.getLogger(__name__)

ISAS = ("scalar", "avx2", "avxvnni", "avx512vnni")  # the kernel's isa code is the index
TYPES = (Q4_0, Q4_1, Q8_0)
PACKED_BITS = {Q4_0: 8, Q4_1: 8, Q8_0: 16}  # block type -> the activation bits whose calls pack (pack_rows)
# mode -> block type -> the bits its linears quantize their inputs to
ACTIVATION_BITS = {"gguf-int8dot": {Q4_0: 8, Q4_1: 8, Q8_0: 16}, "gguf-int16dot": {Q4_0: 16, Q4_1: 16, Q8_0: 16}}
QUANTIZE_EVENT = "pdserve::quantize_activations"  # the profiler's name for the activations' quantization
# The GGUF mode `auto` serves a GGUF model's decode with. Decided once, by a recorded run,
# never at start-up: an integer-dot mode only where `pdserve bench quantization` found its
# greedy agreement with float32 on its 100 prompts at least gguf-fast's (it prints the
# verdict; docs/performance.md keeps the run). An integer-dot mode's KV differs from
# float32's (kv_weights): choosing one needs the prefill's `auto` to pick the same mode
# (worker.settings.engine_quantization).
AUTO_DECODE_MODE = "gguf"


@dataclass(frozen=True, slots=True)
class Int8Activations:
    """x [M, K] as blocks of 32: x[m, 32 b + j] ~= scales[m, b] * q[m, 32 b + j]."""

    q: torch.Tensor  # int8 [M, K], each in [-127, 127]; or int16, in [-32767, 32767]
    scales: torch.Tensor  # float32 [M, K / 32]
    sums: torch.Tensor  # float32 [M, K / 32]: sum of each block's q (an exact integer)

    def dequantize(self) -> torch.Tensor:
        """The float32 activations these blocks stand for (what the integer dot multiplies)."""
        m, k = self.q.shape
        return (self.q.view(m, -1, 32).float() * self.scales.unsqueeze(-1)).view(m, k)


def quantize_activations(x: torch.Tensor, bits: int = 8, isa: str | None = None) -> Int8Activations:
    """x float32 [M, K], K a multiple of 32, as 8-bit (or 16-bit) blocks, on `isa` (default:
    this process's path; every vector path quantizes with AVX2, alike the scalar one)."""
    module = cpu_native.int8_dot_module()
    code = ISAS.index(isa or chosen_isa())
    if torch.autograd._profiler_enabled():  # a pybind call is invisible to the profiler: name it
        with torch.profiler.record_function(QUANTIZE_EVENT):
            return Int8Activations(*module.quantize_activations(x.contiguous(), bits, code))
    return Int8Activations(*module.quantize_activations(x.contiguous(), bits, code))


def supported_isas() -> tuple[str, ...]:
    """The paths this CPU runs, lowest first (scalar always)."""
    return tuple(ISAS[code] for code in cpu_native.int8_dot_module().supported_isas())


def choose_isa(setting: str, supported: tuple[str, ...]) -> str:
    """The path for PDSERVE_CPU_ISA=`setting`: `native` takes the best of `supported`; a
    named path must be one of them (a path the CPU lacks would fault, not fall back)."""
    if setting == "native":
        return supported[-1]
    if setting not in supported:
        raise ValueError(f"PDSERVE_CPU_ISA={setting}: this CPU runs only {', '.join(supported)}")
    return setting


@functools.cache
def chosen_isa() -> str:
    """This process's path, chosen once and logged with what the CPU reports."""
    supported = supported_isas()
    isa = choose_isa(cpu_native.isa_setting(), supported)
    log.info("integer-dot GGUF kernels: %s path on %s (CPU runs %s; torch's capability %s; "
             "PDSERVE_CPU_ISA picks another)", isa, cpu_model(), ", ".join(supported),
             torch.backends.cpu.get_cpu_capability())
    return isa


@functools.cache
def cpu_model() -> str:
    """The CPU's model name as the OS reports it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def int8dot_linear(x: Int8Activations, weight: QuantWeight, bias: torch.Tensor | None = None,
                   isa: str | None = None) -> torch.Tensor:
    """x's blocks against `weight`'s: [M, out_features] float32, on `isa` (default: this
    process's path)."""
    if weight.qtype not in TYPES:
        raise ValueError(f"{weight.type_name} has no integer-dot kernel")
    code = ISAS.index(isa or chosen_isa())
    module = cpu_native.int8_dot_module()
    if torch.autograd._profiler_enabled():  # a pybind call is invisible to the profiler: name it
        with torch.profiler.record_function(GEMM_EVENT):
            return module.int8dot_linear(x.q, x.scales, x.sums, weight.blocks, weight.qtype, bias, code)
    return module.int8dot_linear(x.q, x.scales, x.sums, weight.blocks, weight.qtype, bias, code)


def packs(qtype: int, bits: int, isa: str | None = None) -> bool:
    """Whether `bits`-bit activations against `qtype` blocks take the packed layout on `isa`
    (default: this process's path): on every vector path, 8-bit ones against Q4_0 and Q4_1,
    16-bit ones against Q8_0."""
    return PACKED_BITS.get(qtype) == bits and (isa or chosen_isa()) != "scalar"


def pack_rows(weight: QuantWeight) -> torch.Tensor:
    """`weight`'s blocks in groups of 16 rows, each block's 16 scales together and its
    weights interleaved 4 bytes (Q8_0: 2) a row (the layout `csrc/cpu_int8_dot.cpp`'s
    packed_group reads): as many bytes as the blocks, one vector lane a row."""
    return cpu_native.int8_dot_module().pack_rows(weight.blocks, weight.qtype)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, weight: QuantWeight,
                  bias: torch.Tensor | None = None, isa: str | None = None) -> torch.Tensor:
    """x float32 [M, K] quantized to blocks (PACKED_BITS) and multiplied by `packed`
    (pack_rows of `weight`) in one native call, on vector path `isa` (default: this
    process's): [M, out_features] float32."""
    module = cpu_native.int8_dot_module()
    code = ISAS.index(isa or chosen_isa())
    if torch.autograd._profiler_enabled():  # a pybind call is invisible to the profiler: name it
        with torch.profiler.record_function(GEMM_EVENT):
            return module.packed_linear(x, packed, weight.qtype, weight.out_features, bias, code)
    return module.packed_linear(x, packed, weight.qtype, weight.out_features, bias, code)


class Int8DotLinear:
    """An integer-dot mode's linear over one weight's blocks: integer dots for decode-sized
    calls, the exact expanded GEMM for prompts (see the module docstring)."""

    __slots__ = ("weight", "bits", "packed", "_step")

    def __init__(self, weight: QuantWeight, bits: int) -> None:
        self.weight, self.bits = weight, bits
        self.packed = pack_rows(weight) if packs(weight.qtype, bits) else None
        self._step = None  # packed: the native call and its constant arguments, looked up once
        if self.packed is not None:
            self._step = (cpu_native.int8_dot_module().packed_linear, self.packed, weight.qtype,
                          weight.out_features, ISAS.index(chosen_isa()))

    @classmethod
    def build(cls, weight: QuantWeight, mode: str = "gguf-int8dot") -> Int8DotLinear | None:
        """The linear of integer-dot `mode` (ACTIVATION_BITS); None for a type without an
        integer-dot kernel: that linear runs exact."""
        if weight.qtype not in TYPES:
            log.info("%s blocks have no integer-dot kernel: that linear runs the exact kernel", weight.type_name)
            return None
        chosen_isa()  # chosen and logged at load, not on the first request
        return cls(weight, ACTIVATION_BITS[mode][weight.qtype])

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    @property
    def out_features(self) -> int:
        return self.weight.out_features

    @property
    def in_features(self) -> int:
        return self.weight.in_features

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        step = self._step
        if step is not None and x.dim() == 2 and x.shape[0] < GEMM_ROWS and not torch.autograd._profiler_enabled():
            # a decode step's call, with no Python work around the native one: a step makes
            # one per linear, and the native call of a small linear is a few microseconds
            call, packed, qtype, n, code = step
            return call(x, packed, qtype, n, bias, code)  # (it makes x contiguous itself)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        if x2.shape[0] >= GEMM_ROWS:
            y = _expanded_linear(cpu_native.quant_module(), x2, self.weight, bias)
        elif self.packed is not None:
            y = packed_linear(x2, self.packed, self.weight, bias)
        else:
            y = int8dot_linear(quantize_activations(x2, self.bits), self.weight, bias)
        return y.reshape(*lead, self.weight.out_features)

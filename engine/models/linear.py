"""Weights of a linear layer, prepacked once at load for the CPU GEMM library.

Opt-in int8 (`quantize="int8"`): each output channel's weights are scaled into int8 once at
load and packed for fbgemm/oneDNN's dynamic quantized GEMM, which quantizes the activations
per call. A quarter of the weight bytes and about 2x the fp32 GEMM's speed at decode batch
sizes here, at the price of small numeric differences (bench `quantization` measures them).

MKL's small-batch path streams fp32 weights at well under half the memory bandwidth when a
decode step has a handful of rows; oneDNN with the weight reordered into its blocked layout
(`mkldnn._reorder_linear_weight`, done once) runs the same GEMM several times faster.
Same math, fp32 rounding differences only. Other devices/dtypes use F.linear.

A GGUF model's own blocks (`Linear.from_blocks`, `--quantization gguf`): see `kernels.quant`.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from pdserve.common import envs
from pdserve.kernels.quant import FastLinear, QuantWeight, mode_linear, quant_linear


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and envs.get_bool("PDSERVE_CPU_PREPACK"))


class Linear:
    """y = x @ weight.T (+ bias); weight [out, in] as in the checkpoint."""

    __slots__ = ("weight", "bias", "_packed", "_int8", "_blocks", "_fast")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 prepack: bool = False, batch_hint: int = 8, quantize: str = "") -> None:
        self.weight = weight
        self.bias = bias
        self._packed = None
        self._int8 = None
        self._blocks: QuantWeight | None = None
        self._fast: FastLinear | None = None  # or Int8DotLinear: a GGUF mode's own kernel
        if quantize == "int8":
            self._int8 = _pack_int8(weight, bias)
            self.weight = None
        elif prepack:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
            self.weight = None  # the packed copy replaces it: no second set of weight bytes

    @classmethod
    def from_blocks(cls, blocks: QuantWeight, bias: torch.Tensor | None = None, mode: str = "gguf") -> Linear:
        """A linear over GGUF blocks in a GGUF `mode` (`kernels.quant.MODES`): exact (float32
        activations, the native kernel), or the mode's own kernel where it has one for these
        blocks (`FastLinear`: bfloat16 activations; `Int8DotLinear`: 8-bit activations)."""
        linear = cls.__new__(cls)
        linear.weight, linear.bias, linear._packed, linear._int8 = None, bias, None, None
        linear._blocks, linear._fast = blocks, mode_linear(blocks, mode)
        if linear._fast is not None:
            linear._blocks = None
        return linear

    @property
    def macs_per_row(self) -> int:
        """Multiply-adds per input row: out_features x in_features."""
        for held in (self._blocks, self._fast):
            if held is not None:
                return held.out_features * held.in_features
        if self.weight is not None:
            return self.weight.numel()
        if self._packed is not None:
            return self._packed.numel()
        return self.weight_bytes  # int8: one byte per weight

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one call reads (the bound of a memory-bound step)."""
        for held in (self._blocks, self._fast):
            if held is not None:
                return held.nbytes
        if self.weight is not None:
            return self.weight.numel() * self.weight.element_size()
        if self._packed is not None:
            return self._packed.numel() * self._packed.element_size()
        rows, cols = torch.ops.quantized.linear_unpack(self._int8)[0].shape
        return rows * cols  # int8

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._blocks is not None:
            return quant_linear(x, self._blocks, self.bias)
        if self._fast is not None:
            return self._fast(x, self.bias)
        if self._int8 is not None:
            # reduce_range: 7-bit activations, which x86's int8 dot products need to avoid overflow
            return torch.ops.quantized.linear_dynamic(x, self._int8, True)
        if self._packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


def _pack_int8(weight: torch.Tensor, bias: torch.Tensor | None):
    """Symmetric per-output-channel int8 weights, packed for `quantized.linear_dynamic`."""
    if "x86" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "x86"
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch marks quantized tensors deprecated (for torchao); 2.13 has them
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch.quantize_per_channel(w, scales, zero, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.float())

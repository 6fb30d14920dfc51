"""Weights of a linear layer, prepacked once at load for the CPU GEMM library.

MKL's small-batch path streams fp32 weights at well under half the memory bandwidth when a
decode step has a handful of rows; oneDNN with the weight reordered into its blocked layout
(`mkldnn._reorder_linear_weight`, done once) runs the same GEMM several times faster
(SmolLM2's 49,152 x 576 output projection at 8 rows: ~60 -> ~16 ms on the shared 2-core
CPU). Same math, fp32 rounding differences only. Other devices/dtypes use F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.common import envs


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and envs.get_bool("PDSERVE_CPU_PREPACK"))


class Linear:
    """y = x @ weight.T (+ bias); weight [out, in] as in the checkpoint."""

    __slots__ = ("weight", "bias", "_packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 prepack: bool = False, batch_hint: int = 8) -> None:
        self.weight = weight
        self.bias = bias
        self._packed = None
        if prepack:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
            self.weight = None  # the packed copy replaces it: no second set of weight bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

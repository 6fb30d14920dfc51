"""The small steps of a decoder layer, fused: `add_rms_norm` (residual add + RMSNorm) and
`rope_store_kv` (rotary embedding of q and k + the KV-cache write). On CPU in float32 each is
one native call (`csrc/cpu_fused_layer.cpp`); elsewhere, and where the native build is off
or failed, the same math runs as torch operators (the reference the native path is tested
against)."""
from __future__ import annotations

import torch

from pdserve.kernels import cpu_native
from pdserve.kernels.checks import KernelArgumentError
from pdserve.kernels.kv_store import store_kv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' order of operations: normalise in float32, scale in the input dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, 1, D]: rotate the two halves of each head (transformers'
    rotate_half convention)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _native(*tensors: torch.Tensor) -> object | None:
    for t in tensors:  # a plain loop: this runs ~90 times a decode step
        if t.dtype != torch.float32 or t.device.type != "cpu":
            return None
    return cpu_native.fused_layer_module()


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`h += delta` in place (when given), then RMSNorm(h) * weight. h, delta [T, N]."""
    native = _native(h, weight)
    if native is not None and h.is_contiguous() and (delta is None or delta.is_contiguous()):
        return native.add_rms_norm(h, delta, weight, eps)
    if delta is not None:
        h += delta
    return rms_norm(h, weight, eps)


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """qkv [T, (num_heads + 2 num_kv_heads) * D] (q, k, v side by side); cos/sin [T, D].
    Rotates q and k, writes k and v into `kv_cache` at `slot_mapping` (-1: skipped), returns
    the rotated q [T, num_heads, D], contiguous."""
    T, D = qkv.shape[0], cos.shape[-1]
    native = _native(qkv, cos, kv_cache)
    if native is not None and qkv.is_contiguous() and kv_cache.is_contiguous():
        try:
            return native.rope_store_kv(qkv, cos.contiguous(), sin.contiguous(), kv_cache, slot_mapping,
                                        num_heads, num_kv_heads)
        except RuntimeError as e:  # its argument checks
            raise KernelArgumentError(str(e).splitlines()[0]) from None
    q, k, v = qkv.reshape(T, num_heads + 2 * num_kv_heads, D).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    store_kv(rotate(k, cos, sin).contiguous(), v.contiguous(), kv_cache, slot_mapping)
    return rotate(q, cos, sin).contiguous()

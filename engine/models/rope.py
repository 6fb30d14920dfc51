"""Rotary position embedding: inverse frequencies (plain, linear, llama3) and their use."""
from __future__ import annotations

import math

import torch

from pdserve.engine.config import ModelConfig
from pdserve.common.errors import ModelLoadError


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling_dict
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    raise ModelLoadError(f"unsupported rope scaling {kind!r} (default, linear, llama3)")


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths (beyond old_ctx / low_freq_factor) are slowed down by
    # `factor`, short ones (under old_ctx / high_freq_factor) are kept, and the band between
    # is a linear blend of the two in 1/wavelength.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
    return torch.where(is_mid, blended, scaled)


class RotaryEmbedding:
    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.inv_freq = inverse_frequencies(config).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, D] of each position (each half of D repeated, for `rotate`)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

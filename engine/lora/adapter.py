"""A LoRA adapter in PEFT's format, read and checked against the model it is to run on.

PEFT writes `adapter_config.json` (rank `r`, `lora_alpha`, `target_modules`, ...) and
`adapter_model.safetensors` with one pair of tensors per adapted linear:

    base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_B.weight   [out, r]

and the adapted linear computes y = W x + scaling * B (A x), scaling = lora_alpha / r
(lora_alpha / sqrt(r) with `use_rslora`). Only safetensors is read: a pickled
`adapter_model.bin` is refused, never unpickled. Anything this engine cannot apply exactly
(DoRA, trained biases, extra saved modules, per-module alphas) is refused by name rather
than served approximately.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.common.errors import LoraAdapterError
from pdserve.engine.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's module names, in the order the forward's fused linears stack them
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
MAX_CONFIG_BYTES = 1 << 20


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module of `config`'s layers."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv), "v_proj": (c.hidden_size, kv),
            "o_proj": (q, c.hidden_size), "gate_proj": (c.hidden_size, c.intermediate_size),
            "up_proj": (c.hidden_size, c.intermediate_size), "down_proj": (c.intermediate_size, c.hidden_size)}


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A loaded adapter. `weights[(layer, module)] = (A [rank, in], B [out, rank])` in
    float32 on the CPU; a (layer, module) absent from it is not adapted. `digest` names
    its name and content: KV computed under it is keyed by it (prefix cache, hand-offs)."""

    name: str
    path: str
    rank: int
    alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    digest: str = ""

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def load_peft_adapter(path: str | os.PathLike, model_config: ModelConfig, *, max_rank: int,
                      allowed_root: str | os.PathLike | None = None, name: str = "") -> LoraAdapter:
    """Read and check the PEFT adapter in directory `path` for a model of `model_config`.
    LoraAdapterError names what is wrong: a path outside `allowed_root`, a missing file, a
    pickled checkpoint, a rank over `max_rank`, an unsupported option, a target module the
    model lacks, a layer it does not have, or tensors whose shapes disagree with it."""
    directory = _resolve(path, allowed_root)
    config = _read_config(directory)
    rank, alpha, scaling, declared = _check_config(config, max_rank)
    tensors = _read_tensors(directory)
    weights = _pairs(tensors, model_config, rank)
    modules = tuple(m for m in TARGET_MODULES if any(key[1] == m for key in weights))
    if declared is not None and set(declared) != set(modules):
        missing = sorted(set(declared) - set(modules))
        raise LoraAdapterError(f"adapter {str(path)!r}: target modules {missing} have no tensors")
    name = name or directory.name
    return LoraAdapter(name, str(directory), rank, alpha, scaling, modules, weights,
                       _digest(name, rank, scaling, weights))


def _resolve(path: str | os.PathLike, allowed_root: str | os.PathLike | None) -> Path:
    if not str(path):
        raise LoraAdapterError("the adapter path is empty")
    directory = Path(os.path.realpath(path))
    if allowed_root is not None:
        root = Path(os.path.realpath(allowed_root))
        if directory != root and root not in directory.parents:
            raise LoraAdapterError(f"adapter path {str(path)!r} is outside the allowed root {str(allowed_root)!r}")
    if not directory.is_dir():
        raise LoraAdapterError(f"adapter path {str(path)!r} is not a directory")
    return directory


def _read_config(directory: Path) -> dict:
    file = directory / CONFIG_FILE
    if not file.is_file():
        raise LoraAdapterError(f"adapter {str(directory)!r} has no {CONFIG_FILE}")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise LoraAdapterError(f"{file} is over {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise LoraAdapterError(f"{file} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoraAdapterError(f"{file} is not a JSON object")
    return config


def _check_config(config: dict, max_rank: int) -> tuple[int, float, float, tuple[str, ...] | None]:
    """(rank, alpha, scaling, declared target modules or None for a regex) of a PEFT config."""
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraAdapterError(f"peft_type {peft_type!r} is not supported (LORA only)")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraAdapterError(f"adapter rank r={rank!r} must be a positive integer")
    if rank > max_rank:
        raise LoraAdapterError(f"adapter rank {rank} is over this engine's max_lora_rank {max_rank}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraAdapterError(f"lora_alpha {alpha!r} must be a number")
    for key, unsupported in (("use_dora", True), ("fan_in_fan_out", True)):
        if config.get(key) == unsupported:
            raise LoraAdapterError(f"adapters with {key}={unsupported} are not supported")
    if config.get("bias", "none") != "none":
        raise LoraAdapterError(f"adapters with trained biases (bias={config.get('bias')!r}) are not supported")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_pattern", "trainable_token_indices"):
        if config.get(key):
            raise LoraAdapterError(f"adapters with {key} are not supported")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    targets = config.get("target_modules")
    if isinstance(targets, str):
        return rank, float(alpha), float(scaling), None  # a regex: the tensors say which
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise LoraAdapterError(f"target_modules {targets!r} must be a list of module names")
    lacking = sorted(set(targets) - set(TARGET_MODULES))
    if lacking:
        raise LoraAdapterError(f"target modules {lacking} are not in this model "
                               f"(LoRA may target {', '.join(TARGET_MODULES)})")
    return rank, float(alpha), float(scaling), tuple(targets)


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = directory / WEIGHTS_FILE
    if not file.is_file():
        if (directory / "adapter_model.bin").exists():
            raise LoraAdapterError(f"adapter {str(directory)!r} has only a pickled adapter_model.bin; "
                                   f"pdserve reads {WEIGHTS_FILE} only (save it with safe_serialization)")
        raise LoraAdapterError(f"adapter {str(directory)!r} has no {WEIGHTS_FILE}")
    try:
        return load_file(str(file), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoraAdapterError(f"{file} cannot be read: {exc}") from None


def _pairs(tensors: dict[str, torch.Tensor], model_config: ModelConfig, rank: int
           ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Each adapted (layer, module)'s (A, B), checked against the model's shapes."""
    shapes = module_shapes(model_config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoraAdapterError(f"adapter tensor {key!r} is not a LoRA A/B weight of a decoder layer")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if module not in shapes:
            raise LoraAdapterError(f"adapter tensor {key!r}: module {module!r} is not in this model")
        if layer >= model_config.num_layers:
            raise LoraAdapterError(f"adapter tensor {key!r}: the model has {model_config.num_layers} layers")
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise LoraAdapterError("the adapter has no LoRA tensors")
    out = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoraAdapterError(f"layer {layer} {module}: lora_{'B' if 'A' in pair else 'A'} is missing")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoraAdapterError(
                f"layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} disagree with "
                f"rank {rank} and the model's [{fan_out}, {fan_in}] weight (expected ({rank}, {fan_in}) / "
                f"({fan_out}, {rank}))")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise LoraAdapterError(f"layer {layer} {module}: LoRA weights must be floating point")
        out[(layer, module)] = (a.float().contiguous(), b.float().contiguous())
    return out


def _digest(name: str, rank: int, scaling: float, weights: dict) -> str:
    """SHA-256 over the name, rank, scaling and every tensor's position, shape and bytes."""
    h = hashlib.sha256(f"pdserve-lora-v1\0{name}\0{rank}\0{scaling!r}\0".encode())
    for (layer, module), (a, b) in sorted(weights.items()):
        h.update(f"{layer}\0{module}\0{tuple(a.shape)}\0{tuple(b.shape)}\0".encode())
        h.update(a.numpy().tobytes())
        h.update(b.numpy().tobytes())
    return h.hexdigest()[:32]

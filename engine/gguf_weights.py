"""The linears of a GGUF file as its own quantized blocks, under transformers' names, for
`--quantization gguf` / `gguf-fast` / `gguf-int8dot` / `gguf-int16dot` (see `kernels.quant`).

The float32 model the engine would otherwise serve is the same file dequantized (by
transformers, which also undoes llama.cpp's reordering of the q and k rows). Each block
tensor is taken only if it dequantizes bit for bit to that float32 weight, as read or with
the q/k rows put back in transformers' order: a tensor that matches neither stays float32
(logged), so a quantized model never serves different weights than the float32 one.
"""
from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path

import torch

from pdserve.common.errors import ModelLoadError
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.kernels import cpu_native, int8_dot
from pdserve.kernels.quant import INTEGER_DOT_MODES, NATIVE_TYPES, QuantWeight

log = logging.getLogger(__name__)

_LAYER_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                  "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def gguf_blocks(mode: str, loaded, state: dict[str, torch.Tensor]) -> dict[str, QuantWeight]:
    """The block linears to serve under a GGUF mode (`kernels.quant.MODES`): a
    GGUF model's own blocks, those that dequantize bit for bit to `state`; said once at
    start-up."""
    if loaded.gguf_path is None:
        raise ModelLoadError(f"--quantization {mode} serves a GGUF file's own blocks: "
                             f"{loaded.model_dir} is not a GGUF model")
    cpu_native.quant_module()  # raises NativeBuildError with the compiler's reason
    if mode in INTEGER_DOT_MODES:
        cpu_native.int8_dot_module()
    blocks = read_quantized(loaded.gguf_path, state, loaded.model_config)
    kinds = Counter(w.type_name for w in blocks.values())
    log.info("serving %s from its GGUF blocks (--quantization %s, %s activations): %s; "
             "--quantization none serves float32", loaded.name, mode, _ACTIVATIONS[mode],
             ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())) or "no native block type")
    return blocks


_ACTIVATIONS = {"gguf": "float32", "gguf-fast": "bfloat16 for 4-bit blocks",
                "gguf-int8dot": "8-bit blocks (16 into Q8_0) and integer dot products in decode-sized steps",
                "gguf-int16dot": "16-bit blocks and integer dot products in decode-sized steps"}


def resolve_auto(config: EngineConfig, loaded) -> str:
    """`--quantization auto`: a GGUF model's own blocks on CPU in float32 when the native
    kernels build, else its float32 weights (said once either way)."""
    if loaded.gguf_path is None or config.device != "cpu" or config.dtype != "float32":
        return ""
    try:
        cpu_native.quant_module()
    except cpu_native.NativeBuildError as e:
        log.warning("serving the GGUF model as float32: the native block kernels did not build (%s)", e)
        return ""
    return int8_dot.AUTO_DECODE_MODE


def hf_name(gguf_name: str) -> str | None:
    """transformers' name of a GGUF linear weight, or None for anything else (norms...)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_LINEARS:
        return f"model.layers.{match.group(1)}.{_LAYER_LINEARS[match.group(2)]}.weight"
    return None


def read_quantized(gguf_path: Path, state: dict[str, torch.Tensor],
                   config: ModelConfig) -> dict[str, QuantWeight]:
    """The GGUF's linears with a native block type, checked against `state` (the float32
    weights of the same file); logs what stays float32 and why."""
    import gguf
    import numpy as np

    served: dict[str, QuantWeight] = {}
    unsupported: Counter[str] = Counter()
    mismatched: list[str] = []
    for tensor in gguf.GGUFReader(str(gguf_path)).tensors:
        name = hf_name(tensor.name)
        if name is None or name not in state:
            continue
        qtype = int(tensor.tensor_type)
        if qtype not in NATIVE_TYPES:
            unsupported[tensor.tensor_type.name] += 1
            continue
        blocks = QuantWeight(torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True)), qtype)
        matched = _as_served(blocks, state[name], _heads_of(name, config))
        if matched is None:
            mismatched.append(name)
        else:
            served[name] = matched
    if unsupported:
        log.info("GGUF types without a native kernel, served dequantized to float32: %s",
                 ", ".join(f"{kind} ({n} tensors)" for kind, n in sorted(unsupported.items())))
    if mismatched:
        log.warning("%d GGUF tensors do not dequantize to the weights transformers reads from the same "
                    "file, served as float32: %s", len(mismatched), ", ".join(mismatched[:4]))
    return served


def _heads_of(name: str, config: ModelConfig) -> int:
    if name.endswith("q_proj.weight"):
        return config.num_heads
    if name.endswith("k_proj.weight"):
        return config.num_kv_heads
    return 0


def _as_served(blocks: QuantWeight, weight: torch.Tensor, heads: int) -> QuantWeight | None:
    """`blocks` in the row order of `weight` if they dequantize to it exactly, else None."""
    if (blocks.out_features, blocks.in_features) != tuple(weight.shape):
        return None
    if torch.equal(blocks.dequantize(), weight):
        return blocks
    rows = blocks.out_features
    if heads and rows % (2 * heads) == 0:
        # llama.cpp stores each head's rows interleaved (pairs of halves); transformers' order
        # has the two halves apart: row (h, a, i) of transformers is row (h, i, a) of the file
        order = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
        permuted = blocks.permute_rows(order)
        if torch.equal(permuted.dequantize(), weight):
            return permuted
    return None

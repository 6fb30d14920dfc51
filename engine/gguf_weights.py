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
import struct
from collections import Counter
from pathlib import Path

import torch

from pdserve.common.errors import ModelLoadError
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.kernels import cpu_native, int8_dot
from pdserve.kernels.quant import BLOCK_BYTES, INTEGER_DOT_MODES, NATIVE_TYPES, QuantWeight

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

    served: dict[str, QuantWeight] = {}
    unsupported: Counter[str] = Counter()
    mismatched: list[str] = []
    for gguf_name, qtype, data in tensor_blocks(gguf_path):
        name = hf_name(gguf_name)
        if name is None or name not in state:
            continue
        if qtype not in NATIVE_TYPES:
            unsupported[gguf.GGMLQuantizationType(qtype).name] += 1
            continue
        blocks = QuantWeight(torch.from_numpy(data.copy()), qtype)
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


# GGUF metadata value types -> their size in bytes (8: string, 9: array, read apart)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def tensor_blocks(gguf_path: Path):
    """(name, GGML type, uint8 [rows, row bytes] memory map) for each 2-D tensor of a native
    block type in the file, and (name, type, None) for the others: the header read directly,
    its metadata skipped, not parsed (the gguf package builds every field, a tokenizer's
    vocabulary included, which costs seconds)."""
    import numpy as np

    raw = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    buf = memoryview(raw)
    pos = 0

    def take(fmt: str):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    def string() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        return bytes(buf[pos - n:pos]).decode("utf-8", "replace")

    def skip(vtype: int) -> None:
        nonlocal pos
        if vtype == 8:
            n = take("Q")  # not `pos += take(...)`: that adds to the position read before take moved it
            pos += n
        elif vtype == 9:
            etype, count = take("IQ")
            if etype in _SCALAR_BYTES:
                pos += count * _SCALAR_BYTES[etype]
            else:
                for _ in range(count):
                    skip(etype)
        elif vtype in _SCALAR_BYTES:
            pos += _SCALAR_BYTES[vtype]
        else:
            raise ModelLoadError(f"{gguf_path}: unknown GGUF metadata type {vtype}")

    magic, version, n_tensors, n_kv = take("4sIQQ")
    if magic != b"GGUF" or version < 2:
        raise ModelLoadError(f"{gguf_path} is not a GGUF v2+ file")
    alignment = 32
    for _ in range(n_kv):
        key, vtype = string(), take("I")
        if key == "general.alignment" and vtype == 4:
            alignment = take("I")
        else:
            skip(vtype)
    infos = []
    for _ in range(n_tensors):
        name, n_dims = string(), take("I")
        dims = [take("Q") for _ in range(n_dims)]
        qtype, offset = take("IQ")
        infos.append((name, dims, qtype, offset))
    start = -(-pos // alignment) * alignment
    for name, dims, qtype, offset in infos:
        if qtype not in NATIVE_TYPES or len(dims) != 2:
            yield name, qtype, None
            continue
        row_bytes = dims[0] // 32 * BLOCK_BYTES[qtype]  # dims run innermost first: [in, out]
        begin = start + offset
        yield name, qtype, raw[begin:begin + row_bytes * dims[1]].reshape(dims[1], row_bytes)


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
    rows = blocks.out_features
    candidates = [blocks]
    if heads and rows % (2 * heads) == 0:
        # llama.cpp stores each head's rows interleaved (pairs of halves); transformers' order
        # has the two halves apart: row (h, a, i) of transformers is row (h, i, a) of the file.
        # Its converter always reorders q and k: that order is tried first.
        order = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
        candidates.insert(0, blocks.permute_rows(order))
    for candidate in candidates:
        if torch.equal(candidate.dequantize(), weight):
            return candidate
    return None

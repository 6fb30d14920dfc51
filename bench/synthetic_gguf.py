"""Decode speed of a ~1B-parameter GGUF, float32 against its own blocks: `pdserve bench gguf-1b`.

SmolLM2-135M is small enough that a batch-8 step is bound by arithmetic, not memory. This
writes a Llama GGUF the size of Llama-3.2-1B's body (2048 wide, 16 layers, FFN 8192, 32 heads,
8 KV heads) with SmolLM2's vocabulary and tokenizer and random weights: Q4_1 blocks for every
linear, Q8_0 for the tied embedding (as the default model's file has them), built straight as
random blocks (no float32 weights to quantize). Then, for float32 (the file dequantized),
`gguf` (exact) and `gguf-fast`, decode tokens/s at each `--batch`, interleaved rounds, best
of `--rounds`, one engine at a time (a 1B float32 model takes 4.3 GB).

The file is written once under the build cache root (about 0.7 GB) and converted to float32
safetensors by the engine's loader like any GGUF (cached too, about 4.5 GB).
"""
from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

from pdserve.bench.cli import HelpFormatter

SHAPE = {"hidden": 2048, "layers": 16, "ffn": 8192, "heads": 32, "kv_heads": 8}
_TOKENIZER_PREFIX = "tokenizer."


def write_gguf(path: Path, hidden: int, layers: int, ffn: int, heads: int, kv_heads: int, seed: int = 0) -> Path:
    """A Llama GGUF of random Q4_1 linears (Q8_0 embedding), SmolLM2's tokenizer. Weights
    have a standard deviation about 0.02, norms are ones."""
    import gguf
    import numpy as np

    from pdserve.engine import default_model

    source = gguf.GGUFReader(str(default_model.locate()))
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name("synthetic-llama-1b")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    for name, field in source.fields.items():
        if name.startswith(_TOKENIZER_PREFIX):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(name, field.contents(), field.types[0], sub)
    head_dim = hidden // heads
    writer.add_tensor("token_embd.weight", _random_blocks(rng, vocab, hidden, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    shapes = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
              "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
              "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        for name, (rows, cols) in shapes.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", _random_blocks(rng, rows, cols, gguf.GGMLQuantizationType.Q4_1),
                              raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path


def _random_blocks(rng, rows: int, cols: int, qtype):
    """[rows, cols / 32 blocks] of random blocks whose values have a std of about 0.02."""
    import gguf
    import numpy as np

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    nblocks = cols // block
    out = np.empty((rows, nblocks, size), dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q8_0:  # d, 32 int8: values d * q, q uniform in +-127
        d = np.full((rows, nblocks, 1), 0.02 / 73.0, dtype=np.float16)
        out[..., :2] = d.view(np.uint8)
        out[..., 2:] = rng.integers(-127, 128, (rows, nblocks, 32), dtype=np.int8).view(np.uint8)
    else:  # Q4_1: d, m, 16 bytes of nibbles: values d * q + m, q uniform in 0..15
        d = np.full((rows, nblocks, 1), 0.02 / 4.6, dtype=np.float16)
        out[..., :2] = d.view(np.uint8)
        out[..., 2:4] = (-7.5 * d).astype(np.float16).view(np.uint8)
        out[..., 4:] = rng.integers(0, 256, (rows, nblocks, 16), dtype=np.uint8)
    return out.reshape(rows, nblocks * size)


def synthetic_path(seed: int = 0) -> Path:
    from pdserve.common import envs

    root = envs.cache_root() / "synthetic"
    root.mkdir(parents=True, exist_ok=True)
    shape = "-".join(f"{k}{v}" for k, v in SHAPE.items())
    path = root / f"synthetic-llama-1b-{shape}-seed{seed}.Q4_1.gguf"
    return path if path.exists() else write_gguf(path, seed=seed, **SHAPE)


def decode_rate(model: str, quantization: str, batch: int, tokens: int, threads: int) -> float:
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    llm = LLM(model, num_threads=threads, quantization=quantization, max_tokens=batch * (tokens + 64) + 256)
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        prompts = [[300 + i, 400 + i, 500 + i, 600 + i] for i in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
        llm.engine.assert_no_leaks()
        return rate
    finally:
        del llm
        gc.collect()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench gguf-1b", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tokens", type=int, default=32, help="decode tokens per request")
    p.add_argument("--quantizations", default="none,gguf,gguf-fast")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    started = time.perf_counter()
    path = synthetic_path(args.seed)
    print(f"synthetic GGUF {path} ({path.stat().st_size / 1e9:.2f} GB, {time.perf_counter() - started:.0f} s)",
          flush=True)
    modes = args.quantizations.split(",")
    for batch in args.batch:
        best = {mode: 0.0 for mode in modes}
        for _ in range(args.rounds):
            for mode in modes:
                rate = decode_rate(str(path), "" if mode == "none" else mode, batch, args.tokens, args.num_threads)
                best[mode] = max(best[mode], rate)
        base = best.get("none") or next(iter(best.values()))
        print(f"batch {batch}, {args.tokens} tokens, {args.num_threads} threads, best of {args.rounds}: "
              + ", ".join(f"{'fp32' if mode == 'none' else mode} {rate:.1f} tok/s ({rate / base:.2f}x)"
                          for mode, rate in best.items()), flush=True)
    return 0

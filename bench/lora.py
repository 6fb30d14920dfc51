"""LoRA's cost in a batched decode: `pdserve bench lora [--concurrency 8] [--adapters 3] ...`.

Keeps `--concurrency` requests in flight on one engine, stepped in this process, first all
on the base model, then spread round-robin over the base model and `--adapters` adapters
(random PEFT adapters of `--rank` over every projection, written to a temporary directory,
or the PEFT directories given with `--adapter-dir`). Prints generated tokens per second of
each run and their ratio; issue 47 asks the mixed run to keep at least 0.8x of base-only.

`--kernels` times only the LoRA updates of one decode step instead (every adapted linear of
the model, `--concurrency` rows spread over the base model and the adapters as the engine
sorts them), on each CPU path (`torch`, `native`) in this process, and prints their ratio.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def write_random_adapter(path: Path, model_config, rank: int, seed: int) -> Path:
    """A PEFT-format LoRA over every projection with random non-zero A and B."""
    import torch
    from safetensors.torch import save_file

    from pdserve.engine.lora.adapter import TARGET_MODULES, module_shapes

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_layers):
        for module, (fan_in, fan_out) in module_shapes(model_config).items():
            part = "self_attn" if module in TARGET_MODULES[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES)}))
    return path


def run(engine, names: list[str | None], concurrency: int, num_requests: int, prompt_len: int,
        max_tokens: int, timeout_s: float) -> float:
    """Generated tokens per second with `concurrency` requests in flight, request i under
    adapter names[i % len(names)] (None: the base model)."""
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    submitted = generated = 0

    def submit() -> None:
        nonlocal submitted
        i = submitted
        prompt = [(i * 7919 + j * 31) % (vocab - 10) + 10 for j in range(prompt_len)]  # no shared prefix
        engine.add_request(prompt, params, lora_name=names[i % len(names)])
        submitted += 1

    for _ in range(min(concurrency, num_requests)):
        submit()
    start = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the run did not end within {timeout_s:g} s")
        deltas, _ = engine.step()
        for d in deltas:
            generated += len(d.new_token_ids)
            if d.finished and submitted < num_requests:
                submit()
    elapsed = time.perf_counter() - start
    engine.assert_no_leaks()
    return generated / elapsed


def random_adapter(model_config, rank: int, seed: int):
    """A LoraAdapter over every projection with random non-zero A and B, in memory."""
    import torch

    from pdserve.engine.lora.adapter import TARGET_MODULES, LoraAdapter, module_shapes

    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(model_config)
    weights = {(layer, m): (torch.randn(rank, shapes[m][0], generator=g) * 0.02,
                            torch.randn(shapes[m][1], rank, generator=g) * 0.02)
               for layer in range(model_config.num_layers) for m in TARGET_MODULES}
    return LoraAdapter(f"random-{seed}", "", rank, 2.0 * rank, 2.0, TARGET_MODULES, weights)


def kernel_times(model_config, path: str, num_adapters: int, rank: int, max_rank: int, rows: int,
                 repeats: int) -> float:
    """Seconds the LoRA updates of one decode step take on `path` (``torch`` or ``native``):
    every (layer, fused linear), `rows` rows spread over the base model (-1) and the adapters."""
    import time

    import torch

    from pdserve.engine.lora.adapter import module_shapes
    from pdserve.engine.lora.slots import GROUPS, SlotWeights

    weights = SlotWeights(model_config, max(1, num_adapters), max_rank, torch.device("cpu"), torch.float32, path)
    for slot in range(num_adapters):
        weights.write(slot, random_adapter(model_config, rank, seed=slot))
    row_slots = sorted(i % (num_adapters + 1) - 1 for i in range(rows))  # the engine sorts rows by slot
    shapes = module_shapes(model_config)
    g = torch.Generator().manual_seed(0)
    ins = {grp: torch.randn(rows, shapes[mods[0]][0], generator=g) for grp, mods in GROUPS.items()}
    outs = {grp: torch.randn(rows, sum(shapes[m][1] for m in mods), generator=g) for grp, mods in GROUPS.items()}
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        batch = weights.batch(row_slots, torch.device("cpu"))
        for layer in range(model_config.num_layers):
            for grp in GROUPS:
                batch.apply(layer, grp, ins[grp], outs[grp])
        best = min(best, time.perf_counter() - start)
    return best


def kernels_main(model_config, args) -> int:
    times = {path: kernel_times(model_config, path, args.adapters, args.rank, max(args.rank, 16),
                                args.concurrency, args.repeats) for path in ("torch", "native")}
    linears = model_config.num_layers * 4
    print(f"LoRA updates of one decode step: {args.concurrency} rows over the base model and {args.adapters} "
          f"adapters of rank {args.rank}, {linears} fused linears, best of {args.repeats}")
    for path, seconds in times.items():
        print(f"{path:>7}: {seconds * 1e3:8.2f} ms a step, {seconds / linears * 1e6:7.1f} us a linear")
    print(f"native / torch: {times['native'] / times['torch']:.2f}x the time")
    return 0


def main(argv: list[str]) -> int:
    from pdserve.bench.cli import HelpFormatter

    parser = argparse.ArgumentParser(prog="pdserve bench lora", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=3, help="adapters in the mixed run")
    parser.add_argument("--adapter-dir", action="append", default=[], help="a PEFT adapter directory (repeat)")
    parser.add_argument("--rank", type=int, default=16, help="rank of the random adapters")
    parser.add_argument("--requests", type=int, default=32, help="requests per run")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--kernels", action="store_true", help="time only the LoRA updates of a step, per CPU path")
    parser.add_argument("--repeats", type=int, default=20, help="steps timed with --kernels (the best counts)")
    args = parser.parse_args(argv)

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    num_adapters = len(args.adapter_dir) or args.adapters
    config = EngineConfig(model=args.model, quantization=args.quantization, device=args.device, dtype=args.dtype,
                          num_threads=args.threads, enable_lora=True, max_loras=max(1, num_adapters),
                          max_lora_rank=max(args.rank, 16))
    engine = LLMEngine(config)
    if args.kernels:
        return kernels_main(engine.model_config, args)
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-lora-") as tmp:
        dirs = [Path(d) for d in args.adapter_dir] or [
            write_random_adapter(Path(tmp) / f"a{i}", engine.model_config, args.rank, seed=i)
            for i in range(num_adapters)]
        names = [f"adapter-{i}" for i in range(len(dirs))]
        for name, path in zip(names, dirs):
            engine.load_lora(name, str(path))
        shape = (args.concurrency, args.requests, args.prompt_len, args.max_tokens, args.timeout_s)
        run(engine, [None], args.concurrency, args.concurrency, args.prompt_len, 4, args.timeout_s)  # warm-up
        base = run(engine, [None], *shape)
        mixed = run(engine, [None, *names], *shape)
    print(f"model {engine.model_name} ({engine.config.quantization or 'float32'}, {args.device}), "
          f"c{args.concurrency}, {args.requests} requests of {args.prompt_len} + {args.max_tokens} tokens")
    print(f"base only:                      {base:8.1f} tokens/s")
    print(f"base + {len(names)} adapters (rank {args.rank}): {mixed:8.1f} tokens/s")
    ratio = mixed / base if base else 0.0
    print(f"ratio {ratio:.2f} ({'meets' if ratio >= 0.8 else 'misses'} issue 47's 0.8x)")
    return 0

"""`pdserve profile`: measure one model on this machine with the real engine (`LLMEngine`,
stepped here one step at a time) and write what the simulator needs (`profile.Profile`).

Every engine step measured becomes one row of work and seconds: prompts of each length alone
at each chunk budget (and again, served from the prefix cache), then batches of sequences
decoding at each context length. `StepCost` is fitted to all rows; the decode steps also make
the profile's `decode_table`; the rows are kept in the profile's `samples`. The transfer links
come from a probe the caller passes (the CLI passes `bench transfer`'s measurement; the planner
imports no benchmark).
"""
from __future__ import annotations

import dataclasses
import os
import random
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Sequence

from pdserve.planner.compat import hash_hex
from pdserve.planner.profile import DecodeTable, Machine, Profile, TransferCost, fit_step_cost

DEFAULT_FRACTION = 0.9  # CacheConfig.free_memory_fraction's default


@dataclass(frozen=True, slots=True)
class Grid:
    """What to measure: prompt lengths x chunk budgets, and batch sizes x context lengths
    (`decode_steps` timed steps each)."""

    prompt_lens: tuple[int, ...] = (32, 128, 512, 1024, 2048)
    chunk_budgets: tuple[int, ...] = (256, 512, 2048)
    batch_sizes: tuple[int, ...] = (1, 4, 16, 32)
    context_lens: tuple[int, ...] = (128, 512, 1024)
    decode_steps: int = 8
    fractions: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)


QUICK = Grid(prompt_lens=(32, 96, 192, 384), chunk_budgets=(256,), batch_sizes=(1, 4, 8), context_lens=(64, 256),
             decode_steps=4, fractions=(0.5, 0.9))

TransferProbe = Callable[[], Sequence[TransferCost]]


def machine() -> Machine:
    """This machine's CPU model, cores, the ISA flags that matter to the kernels, memory."""
    model, flags = "", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = value.split()
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
              "avx_vnni", "amx_bf16", "amx_int8", "amx_tile", "neon", "sve")
    from pdserve.common.util import available_memory_bytes

    return Machine(cpu_model=model, num_cores=os.cpu_count() or 1,
                   isa_flags=tuple(f for f in wanted if f in flags), memory_bytes=available_memory_bytes())


def measure(model: str = "default", *, grid: Grid = Grid(), device: str = "cpu", num_threads: int = 0,
            dtype: str = "float32",
            block_size: int = 16, quantization: str = "auto", speculative_config: str = "",
            transfer_probe: TransferProbe | None = None,
            log: Callable[[str], None] = lambda _: None) -> Profile:
    """A profile of `model` on this machine, the engine on `device` (as the workers' --device)."""
    import torch

    from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from pdserve.engine.llm_engine import LLMEngine

    longest = max(max(grid.prompt_lens), max(grid.context_lens) + grid.decode_steps + 2)
    # every decode batch fits whole, each sequence rounded up to its last block
    room = max(longest * 2, max(grid.batch_sizes) * (max(grid.context_lens) + grid.decode_steps + 2 + block_size))
    config = EngineConfig(model=model, device=device, dtype=dtype, num_threads=num_threads or None,
                          quantization=quantization,
                          speculative=SpeculativeConfig.from_json(speculative_config),
                          cache=CacheConfig(block_size=block_size, max_tokens=room + 4 * block_size, dtype=dtype),
                          scheduler=SchedulerConfig(max_num_tokens=max(grid.chunk_budgets),
                                                    max_batch_size=max(64, max(grid.batch_sizes)),
                                                    max_model_len=None))
    engine = LLMEngine(config)
    threads = torch.get_num_threads()
    log(f"profiling {engine.model_name} with {threads} threads")
    rows: list[tuple[float, float, float, float, float]] = []
    samples = {"prefill": [], "prefill_cached": [], "decode": []}
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    _prefills(engine, grid, rng, vocab, rows, samples, log)
    _decodes(engine, grid, rng, vocab, rows, samples, log)
    step = fit_step_cost(rows)
    points = tuple((d["batch"], d["context"], d["step_s"]) for d in samples["decode"] if d["step_s"] > 0)
    table = DecodeTable(points) if len(grid.batch_sizes) > 1 and points else None
    stats = engine.stats()
    spec = 1.0 + (stats.num_accepted_tokens / stats.num_verified_sequences if stats.num_verified_sequences else 0.0)
    mc = engine.model_config
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    kv_bytes = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * itemsize
    by_fraction = _kv_by_fraction(engine, grid.fractions)
    engine.assert_no_leaks()
    transfers = tuple(transfer_probe()) if transfer_probe else ()
    source = (f"measured by pdserve profile{' --quick' if grid == QUICK else ''} on this machine "
              f"({threads} threads, {len(rows)} engine steps)")
    here = machine()
    if device != "cpu" and torch.cuda.is_available():
        here = dataclasses.replace(here, accelerator=torch.cuda.get_device_name())
    return Profile(model=engine.model_name, compat_hash=hash_hex(engine.compat_hash), device=device, source=source,
                   step=step, kv_bytes_per_token=kv_bytes,
                   kv_tokens=dict(by_fraction).get(DEFAULT_FRACTION, by_fraction[-1][1]),
                   block_size=block_size, max_model_len=engine.max_model_len, threads=threads,
                   spec_tokens_per_step=spec, transfers=transfers, kv_tokens_by_fraction=by_fraction,
                   machine=here, samples=samples, created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   decode_table=table)


def _kv_by_fraction(engine, fractions: Sequence[float]) -> tuple[tuple[float, int], ...]:
    """KV tokens one worker of this model gets at each --free-memory-fraction, with its
    weights loaded (as a worker sizes its cache at start)."""
    from pdserve.engine.config import CacheConfig
    from pdserve.engine.kv_cache_manager import size_num_blocks

    out = []
    for fraction in sorted(set(fractions) | {DEFAULT_FRACTION}):
        cache = dataclasses.replace(engine.config.cache, free_memory_fraction=fraction, max_tokens=None,
                                    num_blocks=None)
        blocks = size_num_blocks(engine.model_config, CacheConfig(**{f.name: getattr(cache, f.name)
                                                                     for f in dataclasses.fields(cache)}),
                                 engine.device) - 1
        out.append((fraction, blocks * engine.kv.block_size))
    return tuple(out)


def _timed_step(engine) -> float:
    started = time.perf_counter()
    engine.step()
    return time.perf_counter() - started


def _prefills(engine, grid: Grid, rng: random.Random, vocab: int, rows: list, samples: dict, log) -> None:
    """Each prompt length alone at each chunk budget, then the same prompt again (prefix hit)."""
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    base = engine.scheduler.config
    for budget in grid.chunk_budgets:
        engine.scheduler.config = dataclasses.replace(base, max_num_tokens=budget)
        for length in grid.prompt_lens:
            prompt = [rng.randrange(3, vocab) for _ in range(length)]
            for kind in ("prefill", "prefill_cached"):
                request = engine.add_request(prompt, params)
                total = 0.0
                while engine.has_unfinished():
                    before = request.num_computed_tokens
                    seconds = _timed_step(engine)
                    start = max(before, request.num_cached_tokens)
                    n = min(request.num_computed_tokens, length) - start
                    if n > 0:
                        rows.append((n, n * (start + n / 2), 0, 0, seconds))
                    total += seconds
                samples[kind].append({"prompt_len": length, "chunk_budget": budget,
                                      "cached": max(0, request.num_cached_tokens), "seconds": round(total, 6)})
            log(f"prefill {length} tokens, chunk budget {budget}: {samples['prefill'][-1]['seconds'] * 1000:.0f} ms "
                f"({samples['prefill_cached'][-1]['seconds'] * 1000:.0f} ms with "
                f"{samples['prefill_cached'][-1]['cached']} cached)")
    engine.scheduler.config = base


def _decodes(engine, grid: Grid, rng: random.Random, vocab: int, rows: list, samples: dict, log) -> None:
    """`batch` sequences of `context` prompt tokens decoding together: the steps after every
    prompt is in (the steps while prompts are computed are not decode rows)."""
    from pdserve.engine.sampling_params import SamplingParams

    base = engine.scheduler.config
    for context in grid.context_lens:
        for batch in grid.batch_sizes:
            # every prompt in one step, so that all of them decode together from the next
            engine.scheduler.config = dataclasses.replace(base, max_num_tokens=batch * context + batch)
            params = SamplingParams(max_tokens=grid.decode_steps + 2, temperature=0.0, ignore_eos=True)
            requests = [engine.add_request([rng.randrange(3, vocab) for _ in range(context)], params)
                        for _ in range(batch)]
            while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests):
                engine.step()
            times, ctx = [], 0
            while engine.has_unfinished():
                decoding = [r for r in requests if not r.is_finished]
                ctx = sum(r.num_computed_tokens for r in decoding)
                seconds = _timed_step(engine)
                if len(decoding) == batch:
                    times.append(seconds)
            # the median step: a step another process on the machine stalled is not the model's cost
            median = sorted(times)[len(times) // 2] if times else 0.0
            if times:
                rows.append((0, 0, batch, ctx, median))
            samples["decode"].append({"batch": batch, "context": context, "step_s": round(median, 6)})
            log(f"decode batch {batch} at context {context}: {median * 1000:.1f} ms per step")
    engine.scheduler.config = base

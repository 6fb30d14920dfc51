"""Offline engine benchmark: pdserve's engine beside transformers `generate`, same prompts,
same run, same machine.

    python -m pdserve.bench.offline            # the full run (SmolLM2, a few minutes on 2 cores)
    python -m pdserve.bench.offline --quick    # small shapes, to check that it runs

Measured, each for pdserve and for transformers:

* batch throughput: output tokens/s for C concurrent requests (~P-token prompts, exactly N new
  tokens each, greedy, EOS ignored) for every C in --concurrency and N in --new-tokens.
  pdserve gets all C requests at once (continuous batching); transformers gets them as one
  left-padded batch. Wall time covers prefill and decode.
* single-stream TTFT: one ~P-token prompt, time until the first output token exists.
* prefill speed: prompt tokens/s for one --prefill-len-token prompt (one output token).

Prompts are seeded random token ids (no special tokens), distinct per measurement so the
prefix cache never flatters pdserve (it is also reset before each measurement). Ratios are
written so that > 1 means pdserve is better. Targets (issue 2): batch throughput >= 2x,
prefill speed >= 1x.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from pdserve.common import envs

FIRST_ORDINARY_TOKEN = 256  # below this, SmolLM2-style vocabularies keep special/byte tokens


@dataclass(frozen=True, slots=True)
class Settings:
    model: str
    threads: int
    concurrency: tuple[int, ...]
    new_tokens: tuple[int, ...]
    prompt_len: int
    prefill_len: int
    repeats: int
    seed: int
    run_transformers: bool
    profile: bool = False
    quantization: str = "auto"
    decode_batches: tuple[int, ...] = (1, 8, 32)


@dataclass(frozen=True, slots=True)
class Row:
    """One measurement. `ours`/`theirs` are rates or latencies from wall time; `ratio` > 1
    means pdserve is better. `cpu_ratio` is the same comparison in process CPU seconds for
    the same work (steadier than wall time on a machine others are using)."""

    name: str
    unit: str
    ours: float
    theirs: float | None
    higher_is_better: bool
    cpu_ratio: float | None = None
    agreement: float | None = None  # fraction of requests with the same greedy tokens

    @property
    def ratio(self) -> float | None:
        if self.theirs is None or self.ours <= 0 or self.theirs <= 0:
            return None
        return self.ours / self.theirs if self.higher_is_better else self.theirs / self.ours


def parse_args(argv: Sequence[str]) -> tuple[Settings, Path | None]:
    p = argparse.ArgumentParser(prog="pdserve bench offline", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="'default', a transformers dir or a .gguf")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (both sides)")
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="default: 8 32")
    p.add_argument("--new-tokens", type=int, nargs="+", default=None, help="default: 64 128")
    p.add_argument("--prompt-len", type=int, default=None, help="mean prompt tokens (default 200)")
    p.add_argument("--prefill-len", type=int, default=None, help="default: 1024")
    p.add_argument("--repeats", type=int, default=1, help="runs per measurement; the median is kept")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="small shapes (concurrency 4 8, 16 new tokens, 64-token prompts, 256 prefill)")
    p.add_argument("--no-transformers", action="store_true", help="measure pdserve only")
    p.add_argument("--quantization", default="auto",
                   choices=("auto", "none", "gguf", "gguf-fast", "gguf-int8dot", "gguf-int16dot", "int8"),
                   help="pdserve's weights, as the workers' flag (auto: a .gguf's own blocks)")
    p.add_argument("--decode-batches", type=int, nargs="+", default=None,
                   help="decode-only steps timed at these batch sizes, beside their bound (default: 1 8 32)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one pdserve batch run and print where its time goes")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    a = p.parse_args(list(argv))
    quick = a.quick
    s = Settings(
        model=a.model, threads=a.threads,
        concurrency=tuple(a.concurrency or ((4, 8) if quick else (8, 32))),
        new_tokens=tuple(a.new_tokens or ((16,) if quick else (64, 128))),
        prompt_len=a.prompt_len or (64 if quick else 200),
        prefill_len=a.prefill_len or (256 if quick else 1024),
        repeats=a.repeats, seed=a.seed, run_transformers=not a.no_transformers, profile=a.profile,
        quantization="" if a.quantization == "none" else a.quantization,
        decode_batches=tuple(a.decode_batches or ((1, 4) if quick else (1, 8, 32))))
    if min(s.concurrency + s.new_tokens) < 1 or s.prompt_len < 2 or s.prefill_len < 2 or s.repeats < 1:
        p.error("counts and lengths must be positive (prompt lengths >= 2)")
    if s.threads < 1:
        p.error("--threads must be >= 1")
    return s, a.json


# -- workloads ------------------------------------------------------------------------------

def make_prompts(vocab_size: int, count: int, mean_len: int, seed: int, spread: float = 0.1
                 ) -> list[list[int]]:
    """`count` random prompts of mean_len * (1 +- spread) tokens, reproducible from `seed`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    low = min(FIRST_ORDINARY_TOKEN, vocab_size // 2)
    width = int(mean_len * spread)
    lens = torch.randint(mean_len - width, mean_len + width + 1, (count,), generator=g).tolist()
    return [torch.randint(low, vocab_size, (n,), generator=g).tolist() for n in lens]


@dataclass(frozen=True, slots=True)
class Timing:
    wall_s: float  # median over repeats
    cpu_s: float  # median process CPU time (all threads): less sensitive to other load
    result: object


def measure_pair(ours: Callable[[], object], theirs: Callable[[], object] | None, repeats: int
                 ) -> tuple[Timing, Timing | None]:
    """Runs both sides `repeats` times, interleaved (ours, theirs, theirs, ours, ...) so a
    burst of load from elsewhere on the machine hits both alike; medians of each."""
    runs: dict[str, list[tuple[float, float, object]]] = {"ours": [], "theirs": []}
    sides = [("ours", ours)] + ([("theirs", theirs)] if theirs else [])
    for i in range(repeats):
        for name, fn in (sides if i % 2 == 0 else sides[::-1]):
            c0, t0 = time.process_time(), time.perf_counter()
            result = fn()
            runs[name].append((time.perf_counter() - t0, time.process_time() - c0, result))

    def timing(items) -> Timing:
        return Timing(statistics.median(w for w, _, _ in items), statistics.median(c for _, c, _ in items),
                      items[-1][2])

    return timing(runs["ours"]), (timing(runs["theirs"]) if theirs else None)


# -- the two sides --------------------------------------------------------------------------

class Ours:
    def __init__(self, s: Settings, max_cache_tokens: int) -> None:
        from pdserve.engine.llm import LLM

        self.llm = LLM(s.model, max_tokens=max_cache_tokens,
                       max_batch_size=max(64, max(s.concurrency), max(s.decode_batches)),
                       quantization=s.quantization)
        self.vocab_size = self.llm.engine.model_config.vocab_size

    def _fresh(self) -> None:
        self.llm.engine.kv.pool.reset_prefix_cache()

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        from pdserve.engine.sampling_params import SamplingParams

        self._fresh()
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate(prompts, params)
        assert all(len(o.token_ids) == n for o in outs)
        return [list(o.token_ids) for o in outs]

    def first_token(self, prompt: list[int]) -> None:
        """Streams one request until its first token exists (the TTFT path)."""
        from pdserve.engine.sampling_params import SamplingParams

        self._fresh()
        for out in self.llm.generate_stream(prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                                   ignore_eos=True)):
            if out.new_token_ids:
                return
        raise RuntimeError("no token came back")

    def close(self) -> None:
        self.llm.engine.assert_no_leaks()


class Transformers:
    def __init__(self, model_dir: Path) -> None:
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        self.model.generation_config.eos_token_id = None  # exact lengths, like ignore_eos
        self.pad_id = 0

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=self.pad_id)
        return out[:, width:].tolist()

    def first_token(self, prompt: list[int]) -> None:
        self.generate([prompt], 1)


# -- the run --------------------------------------------------------------------------------

def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / max(1, len(a))


def compare(name: str, unit: str, work: float, higher_is_better: bool, ours: Callable[[], object],
            theirs: Callable[[], object] | None, repeats: int, check_tokens: bool = True) -> Row:
    """`work` (tokens) turns seconds into a rate; with higher_is_better False, rows are in ms."""
    a, b = measure_pair(ours, theirs, repeats)

    def value(t: Timing) -> float:
        return work / t.wall_s if higher_is_better else t.wall_s * 1e3

    if b is None:
        return Row(name, unit, value(a), None, higher_is_better)
    return Row(name, unit, value(a), value(b), higher_is_better, cpu_ratio=b.cpu_s / a.cpu_s,
               agreement=agreement(a.result, b.result) if check_tokens else None)


def run(s: Settings, log: Callable[[str], None]) -> list[Row]:
    import torch

    torch.set_num_threads(s.threads)
    widest = max(max(s.concurrency), max(s.decode_batches))  # the decode steps hold their batch too
    need = max(widest * (s.prompt_len * 11 // 10 + 1 + max(s.new_tokens)), s.prefill_len + 16)
    t0 = time.perf_counter()
    ours = Ours(s, max_cache_tokens=need + 1024)
    log(f"pdserve engine loaded in {time.perf_counter() - t0:.1f} s "
        f"({ours.llm.engine.model_name}, weights {ours.llm.engine.config.quantization or 'float32'}, "
        f"{ours.llm.engine.kv.num_blocks - 1} KV blocks)")
    theirs = Transformers(ours.llm.engine.loaded.model_dir) if s.run_transformers else None
    vocab = ours.vocab_size
    seeds = iter(range(s.seed * 1000, s.seed * 1000 + 1000))

    # warm-up: first-call costs (allocator growth, kernel selection) stay out of the numbers
    warm = make_prompts(vocab, min(8, max(s.concurrency)), s.prompt_len, next(seeds))
    ours.generate(warm, 4)
    if theirs:
        theirs.generate(warm, 4)

    rows: list[Row] = []
    for c in s.concurrency:
        for n in s.new_tokens:
            prompts = make_prompts(vocab, c, s.prompt_len, next(seeds))
            rows.append(compare(
                f"batch {c} x ~{s.prompt_len} prompt, {n} new", "out tok/s", c * n, True,
                lambda: ours.generate(prompts, n),
                (lambda: theirs.generate(prompts, n)) if theirs else None, s.repeats))
            log(format_row(rows[-1]))

    (prompt,) = make_prompts(vocab, 1, s.prompt_len, next(seeds))
    rows.append(compare(f"TTFT, 1 stream, {len(prompt)}-token prompt", "ms", 1, False,
                        lambda: ours.first_token(prompt),
                        (lambda: theirs.first_token(prompt)) if theirs else None,
                        max(3, s.repeats), check_tokens=False))
    log(format_row(rows[-1]))

    (long_prompt,) = make_prompts(vocab, 1, s.prefill_len, next(seeds), spread=0.0)
    rows.append(compare(f"prefill, {s.prefill_len}-token prompt", "prompt tok/s", s.prefill_len, True,
                        lambda: ours.generate([long_prompt], 1),
                        (lambda: theirs.generate([long_prompt], 1)) if theirs else None, s.repeats))
    log(format_row(rows[-1]))
    machine = measure_machine(s.threads)
    log(machine.describe(s.threads))
    model = ours.llm.engine.model
    for batch in s.decode_batches:
        step = decode_step(ours.llm, make_prompts(vocab, batch, s.prompt_len, next(seeds)))
        bound = step_bound(model, batch, machine)
        rows.append(Row(f"decode step, batch {batch}", "ms", step.ms, None, False))
        log(format_row(rows[-1]) + f"  bound {bound.ms:.2f} ms, step/bound {step.ms / bound.ms:.2f}: {bound.why}")
        log(f"  one step: {step.num_ops} operator calls, {step.gemm_share:.0%} of its CPU time in GEMM "
            f"({step.gemm_ms:.1f} ms), top: {step.top}")
    if s.profile:
        prompts = make_prompts(vocab, max(s.concurrency), s.prompt_len, next(seeds))
        log(profile_batch(lambda: ours.generate(prompts, min(s.new_tokens))))
    ours.close()
    return rows


@dataclass(frozen=True, slots=True)
class StepProfile:
    ms: float  # mean wall time of a decode-only step
    num_ops: int  # aten/quantized operator calls in one step (nested calls included)
    gemm_ms: float  # self CPU time of the matrix multiplications in that step
    gemm_share: float  # of the step's self CPU time
    top: str  # the operators with the most self CPU time


GEMM_OPS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::mkldnn_linear", "aten::_mkl_linear",
            "quantized::linear_dynamic", "mkldnn::_linear_pointwise", "aten::_weight_int8pack_mm",
            "aten::linear", "aten::_weight_int4pack_mm_for_cpu", "pdserve::quant_linear")


@dataclass(frozen=True, slots=True)
class Machine:
    read_gbs: float  # streaming reads from memory (a sum over 512 MB)
    gemm_gflops: float  # float32 GEMM with cache-resident operands
    # the integer-dot kernel on cache-resident Q4_1 blocks by activation bits (2 ops a
    # multiply-add); empty without the kernel
    int_dot_gops: dict[int, float]
    isa: str  # the integer-dot kernel's instruction-set path
    cpu: str  # the CPU's model name

    def describe(self, threads: int) -> str:
        rates = ", ".join(f"{g:.0f} GOP/s with {bits}-bit activations" for bits, g in self.int_dot_gops.items())
        int8 = f"integer dot ({self.isa} path) {rates}" if rates else "no integer-dot kernel"
        return (f"this machine: {self.cpu}, {threads} threads: {self.read_gbs:.1f} GB/s streaming reads, "
                f"{self.gemm_gflops:.0f} GFLOP/s float32 GEMM, {int8}, on cache-resident weights")


@dataclass(frozen=True, slots=True)
class Bound:
    ms: float
    why: str


def measure_machine(threads: int) -> Machine:
    """What bounds a decode step here: memory bandwidth, float32 GEMM and integer-dot
    throughput, best of 5."""
    import torch

    from pdserve.kernels import int8_dot

    big = torch.ones(128 << 20)  # 512 MB: far beyond any cache
    a, b = torch.randn(64, 576), torch.randn(576, 1536)  # 3.5 MB: stays in L2/L3
    big.sum()
    read = min(_timed(big.sum) for _ in range(5))
    gemm = min(_timed(lambda: [torch.mm(a, b) for _ in range(20)]) for _ in range(5))
    try:
        isa, rates = int8_dot.chosen_isa(), {bits: _int_dot_gops(bits) for bits in (8, 16)}
    except Exception as e:  # noqa: BLE001 - no compiler here: the bound leaves the integer rate out
        isa, rates = f"none ({e})", {}
    return Machine(read_gbs=big.numel() * 4 / read / 1e9, gemm_gflops=20 * 2 * 64 * 576 * 1536 / gemm / 1e9,
                   int_dot_gops=rates, isa=isa, cpu=int8_dot.cpu_model())


def _int_dot_gops(bits: int, rows: int = 8, n: int = 1536, k: int = 576) -> float:
    """The integer-dot rate on a Q4_1 weight small enough to stay in cache (SmolLM2's gate/up
    shape, 0.55 MB), `rows` activation rows, through the linear a step calls (the packed
    layout where the path has one, the activations' quantization included): the arithmetic
    a step cannot beat."""
    import torch

    from pdserve.kernels import int8_dot, quant

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (n, k // 32 * 20), dtype=torch.uint8, generator=g)
    blocks.view(n, -1, 20)[..., :4] = torch.tensor([0x00, 0x20, 0x00, 0xA0], dtype=torch.uint8)  # d, m
    mode = next(m for m, bits_of in int8_dot.ACTIVATION_BITS.items() if bits_of[quant.Q4_1] == bits)
    linear = int8_dot.Int8DotLinear.build(quant.QuantWeight(blocks, quant.Q4_1), mode)
    x = torch.randn(rows, k, generator=g)
    linear(x)
    seconds = min(_timed(lambda: [linear(x) for _ in range(20)]) for _ in range(5))
    return 20 * 2 * rows * n * k / seconds / 1e9


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def step_bound(model, batch: int, machine: Machine) -> Bound:
    """The shortest a decode step of `batch` rows could take: its linears' weight bytes at the
    machine's read bandwidth, or their multiply-adds at its rate for the kernel each runs
    (the integer-dot rate for the integer-dot modes' few-row calls, float32 GEMM's for the rest),
    whichever is longer. `why` gives both."""
    from pdserve.kernels.int8_dot import Int8DotLinear
    from pdserve.kernels.quant import GEMM_ROWS

    linears = model.linears()
    weight_bytes = sum(lin.weight_bytes for lin in linears)
    memory_ms = weight_bytes / machine.read_gbs / 1e6
    float_ops, int_ops, int_ms = 0, 0, 0.0
    for lin in linears:
        ops = 2 * batch * lin.macs_per_row
        kernel = getattr(lin, "_fast", None)  # a GGUF mode's own kernel (engine.models.linear)
        rate = machine.int_dot_gops.get(kernel.bits) if isinstance(kernel, Int8DotLinear) else None
        if rate is not None and batch < GEMM_ROWS:  # prompt-sized calls take the float32 GEMM
            int_ops, int_ms = int_ops + ops, int_ms + ops / rate / 1e6
        else:
            float_ops += ops
    compute_ms = float_ops / machine.gemm_gflops / 1e6 + int_ms
    why = (f"weights {weight_bytes / 1e6:.0f} MB at {machine.read_gbs:.1f} GB/s = {memory_ms:.2f} ms; "
           f"multiply-adds {int_ops / 2e9:.3f} G integer dot + {float_ops / 2e9:.3f} G float32 = {compute_ms:.2f} ms")
    return Bound(max(memory_ms, compute_ms), why)


def decode_step(llm, prompts: list[list[int]], steps: int = 16) -> StepProfile:
    """Admit `prompts` together, prefill them, then time `steps` steps in which every one of
    them decodes (nothing else runs), and profile one more."""
    from torch.profiler import ProfilerActivity, profile

    from pdserve.engine.sampling_params import SamplingParams

    engine = llm.engine
    engine.kv.pool.reset_prefix_cache()
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts]
    sched = engine.scheduler
    while sched.waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in sched.running):
        engine.step()
    engine.step()  # the last prefill's first token is sampled; from here every step decodes
    if len(sched.running) != len(prompts):
        raise RuntimeError(f"only {len(sched.running)} of {len(prompts)} requests run together: the KV cache "
                           f"or max_batch_size is too small for this decode step")
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    events = [e for e in prof.key_averages() if "::" in e.key]
    num_ops = sum(e.count for e in events if e.key.startswith(("aten::", "quantized::", "mkldnn::", "pdserve")))
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS)
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:5]
    top = ", ".join(f"{e.key} {e.self_cpu_time_total / 1e3:.1f} ms x{e.count}" for e in ranked)
    for rid in ids:
        llm.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return StepProfile(ms, num_ops, gemm / 1e3, gemm / total, top)


def profile_batch(fn: Callable[[], object]) -> str:
    """Top operators by self CPU time over one run of `fn` (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return "profile of one pdserve batch run (self CPU time by operator):\n" + \
        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def format_row(r: Row) -> str:
    theirs = f"{r.theirs:12.1f}" if r.theirs is not None else f"{'-':>12}"
    ratio = f"{r.ratio:5.2f}x" if r.ratio is not None else "     -"
    cpu = f"{r.cpu_ratio:5.2f}x" if r.cpu_ratio is not None else "     -"
    agree = f"  {r.agreement:4.0%}" if r.agreement is not None else ""
    return f"{r.name:<40} {r.unit:<13} {r.ours:10.1f} {theirs}  {ratio}  {cpu}{agree}"


def header(s: Settings) -> str:
    import torch

    from pdserve.kernels import int8_dot

    return (f"pdserve offline benchmark: model {s.model}, float32, CPU {int8_dot.cpu_model()}, "
            f"PDSERVE_CPU_ISA={envs.get('PDSERVE_CPU_ISA')}, torch {torch.__version__}, "
            f"{s.threads} threads, median of {s.repeats} interleaved run(s)\n"
            f"ratio: pdserve vs transformers by wall time, > 1 = pdserve better; cpu: the same in "
            f"process CPU seconds; same: requests with identical greedy tokens\n"
            f"{'measurement':<40} {'unit':<13} {'pdserve':>10} {'transformers':>12}  ratio    cpu  same")


def main(argv: list[str] | None = None) -> int:
    settings, json_path = parse_args(sys.argv[1:] if argv is None else argv)
    print(header(settings), flush=True)
    rows = run(settings, lambda line: print(line, flush=True))
    batch = [r.ratio for r in rows if r.name.startswith("batch") and r.ratio is not None]
    prefill = [r.ratio for r in rows if r.name.startswith("prefill") and r.ratio is not None]
    if batch:
        print(f"targets: batch throughput >= 2x transformers: min {min(batch):.3f}x "
              f"{'OK' if min(batch) >= 2 else 'MISSED'}; prefill >= 1x: {prefill[0]:.3f}x "
              f"{'OK' if prefill[0] >= 1 else 'MISSED'}")
    if json_path:
        json_path.write_text(json.dumps(
            {"settings": asdict(settings),
             "rows": [dict(asdict(r), ratio=r.ratio) for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What each `--quantization` costs and gains: `pdserve bench quantization [--prompts 100]`.

Side by side in one run, on the same model, each quantization (int8, gguf, gguf-fast,
gguf-int8dot, gguf-int16dot) against the float32 engine: greedy agreement over `--prompts` prompts (identical
answers, and the mean share of each answer before the first differing token), run
`--agreement-batch` prompts at a time so that decode steps take the few-row kernels a served
decode runs (a step of 32 rows or more takes the prompt kernels); perplexity of a fixed text,
from each engine's own prompt logprobs, once as one prompt (the prompt kernels) and once in
steps of STEP_TOKENS tokens (the decode kernels); and decode throughput at batch `--batch`,
interleaved rounds, best of `--rounds`. It ends with `auto`'s recorded check: which
integer-dot modes agree with float32 at least as often as gguf-fast (`kernels.int8_dot.
AUTO_DECODE_MODE` is set from that verdict, with the run recorded in docs/performance.md).
"""
from __future__ import annotations

import argparse
import math
import time
import warnings

from pdserve.bench.cli import HelpFormatter

SUBJECTS = ("the moon", "volcanoes", "bees", "the ocean", "bread", "rain", "chess", "bicycles", "glass",
            "trees", "music", "clocks", "salt", "bridges", "owls", "maps", "ice", "paper", "coffee", "stars")
FORMS = ("What is special about {}?", "Explain {} to a child.", "Write one sentence about {}.",
         "List three facts about {}.", "Why do people like {}?")
TEXT = ("The lighthouse stood at the end of a long stone pier, and every evening the keeper climbed its "
        "narrow stairs to light the lamp. Ships passing in the dark counted on that light to find the "
        "harbour, and on stormy nights the keeper stayed awake until dawn, watching the waves break "
        "against the rocks below. In the morning he wrote in his logbook how many ships had passed, "
        "what the weather had been, and whether the lamp had needed any repair. Years later, when the "
        "light was replaced by an automatic beacon, the logbooks were given to the town museum, where "
        "visitors still read them to learn how the sea once shaped every part of life on the coast.")


def prompts(n: int) -> list[str]:
    return [FORMS[i % len(FORMS)].format(SUBJECTS[(i // len(FORMS)) % len(SUBJECTS)]) + f" ({i})"
            for i in range(n)]


STEP_TOKENS = 16  # prompt tokens a step in the decode-kernel perplexity (below the GEMM rows)


def agreement(fp32, other, texts: list[str], max_tokens: int, batch: int) -> tuple[int, float]:
    """(answers identical, mean share of an answer before the first differing token), the
    prompts run `batch` at a time."""
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    a, b = [], []
    for start in range(0, len(texts), batch):
        a += fp32.generate(texts[start:start + batch], params)
        b += other.generate(texts[start:start + batch], params)
    same, shares = 0, []
    for x, y in zip(a, b):
        ids_x, ids_y = list(x.token_ids), list(y.token_ids)
        same += ids_x == ids_y
        prefix = next((i for i, (p, q) in enumerate(zip(ids_x, ids_y)) if p != q), min(len(ids_x), len(ids_y)))
        shares.append(prefix / max(1, len(ids_x)))
    return same, sum(shares) / len(shares)


def perplexity(llm) -> float:
    """Perplexity of TEXT under the engine itself (its prompt logprobs), so every
    quantization is measured through the kernels it serves with."""
    from pdserve.engine.sampling_params import SamplingParams

    out = llm.generate([TEXT], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    logprobs = [entry.logprob for entry in out.prompt_logprobs]
    return math.exp(-sum(logprobs) / len(logprobs))


def step_perplexity(model: str, quantization: str, num_threads: int) -> float:
    """Perplexity of TEXT computed STEP_TOKENS prompt tokens a step: through the kernels a
    decode step runs (an engine of its own, whose step budget is that many tokens)."""
    import gc

    from pdserve.engine.llm import LLM

    llm = LLM(model, num_threads=num_threads, quantization=quantization, max_num_tokens=STEP_TOKENS)
    try:
        return perplexity(llm)
    finally:
        llm.engine.assert_no_leaks()
        del llm
        gc.collect()


def decode_rate(llm, batch: int, max_tokens: int) -> float:
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts(batch), params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench quantization", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--quantizations", default="int8,gguf,gguf-fast,gguf-int8dot,gguf-int16dot",
                   help="comma-separated, each against float32 (the gguf ones need a GGUF model)")
    p.add_argument("--prompts", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--agreement-batch", type=int, default=8,
                   help="prompts decoded together in the agreement check (decode-sized: below 32)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=1)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", module="torch.ao")
    from pdserve.engine.llm import LLM
    from pdserve.kernels import int8_dot

    print(f"CPU {int8_dot.cpu_model()}, integer-dot path {int8_dot.chosen_isa()}, {args.num_threads} threads",
          flush=True)
    engines = {"fp32": LLM(args.model, num_threads=args.num_threads, quantization="")}
    for name in args.quantizations.split(","):
        engines[name] = LLM(args.model, num_threads=args.num_threads, quantization=name)
    agreed = report_accuracy(engines, args)
    print(auto_verdict(agreed, args.prompts), flush=True)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            rates[name].append(decode_rate(llm, args.batch, 64))
    best = {name: max(r) for name, r in rates.items()}
    print(f"decode at batch {args.batch}, 64 tokens, {args.num_threads} threads, best of {args.rounds}: "
          + ", ".join(f"{name} {rate:.1f} tok/s ({rate / best['fp32']:.2f}x)" for name, rate in best.items()),
          flush=True)
    for llm in engines.values():
        llm.engine.assert_no_leaks()
    return 0


def report_accuracy(engines: dict, args) -> dict[str, int]:
    """Prints each quantization's agreement and perplexities; returns the identical answers."""
    texts = prompts(args.prompts)
    base_ppl = perplexity(engines["fp32"])
    base_step = step_perplexity(args.model, "", args.num_threads)
    print(f"perplexity of a fixed {len(TEXT.split())}-word text, fp32: {base_ppl:.4f} as one prompt, "
          f"{base_step:.4f} in {STEP_TOKENS}-token steps", flush=True)
    agreed = {}
    for name, llm in list(engines.items())[1:]:
        same, share = agreement(engines["fp32"], llm, texts, args.max_tokens, args.agreement_batch)
        agreed[name] = same
        ppl, step = perplexity(llm), step_perplexity(args.model, name, args.num_threads)
        print(f"{name}: greedy agreement with fp32 over {args.prompts} prompts, {args.max_tokens} tokens, "
              f"{args.agreement_batch} at a time: {same} identical ({same / args.prompts:.0%}), mean share "
              f"before the first difference {share:.1%}; perplexity {ppl:.4f} ({ppl / base_ppl - 1:+.2%}) as "
              f"one prompt, {step:.4f} ({step / base_step - 1:+.2%}) in {STEP_TOKENS}-token steps", flush=True)
    return agreed


def auto_verdict(agreed: dict[str, int], num_prompts: int) -> str:
    """`auto`'s recorded check, as a line to keep with the run: an integer-dot mode may serve
    decode where its identical answers are at least gguf-fast's."""
    from pdserve.kernels.quant import INTEGER_DOT_MODES

    modes = [m for m in INTEGER_DOT_MODES if m in agreed]
    if "gguf-fast" not in agreed or not modes:
        return "auto's check needs gguf-fast and an integer-dot mode in --quantizations"
    passed = [m for m in modes if agreed[m] >= agreed["gguf-fast"]]
    counts = ", ".join(f"{m} {agreed[m]}" for m in ["gguf-fast", *modes])
    head = f"auto's check, identical of {num_prompts}: {counts}: "
    if not passed:
        return head + "no integer-dot mode qualifies (AUTO_DECODE_MODE stays gguf)"
    return (head + f"{', '.join(passed)} may serve decode "
            f"(set kernels.int8_dot.AUTO_DECODE_MODE to the faster of them, with this run in docs/performance.md)")

"""What `--quantization int8` costs and gains: `pdserve bench quantization [--prompts 100]`.

Side by side in one run, on the same model: greedy agreement of the int8 engine with the
fp32 engine over `--prompts` prompts (identical answers, and the mean share of each answer
before the first differing token); perplexity of a fixed text under transformers' model with
fp32 linears and with the same int8 kernel pdserve uses; and decode throughput of both
engines at batch `--batch`, interleaved rounds, best of `--rounds`.
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


def agreement(fp32, int8, texts: list[str], max_tokens: int) -> tuple[int, float]:
    """(answers identical, mean share of an answer before the first differing token)."""
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    a = fp32.generate(texts, params)
    b = int8.generate(texts, params)
    same, shares = 0, []
    for x, y in zip(a, b):
        ids_x, ids_y = list(x.token_ids), list(y.token_ids)
        same += ids_x == ids_y
        prefix = next((i for i, (p, q) in enumerate(zip(ids_x, ids_y)) if p != q), min(len(ids_x), len(ids_y)))
        shares.append(prefix / max(1, len(ids_x)))
    return same, sum(shares) / len(shares)


def perplexities(model_dir) -> tuple[float, float]:
    """Perplexity of TEXT under transformers' model, fp32 linears then pdserve's int8 ones."""
    import torch
    import transformers

    from pdserve.engine.models.linear import Linear

    class Int8(torch.nn.Module):
        def __init__(self, linear: torch.nn.Linear) -> None:
            super().__init__()
            self.inner = Linear(linear.weight.detach(), None if linear.bias is None else linear.bias.detach(),
                                quantize="int8")

        def forward(self, x):
            shape = x.shape
            return self.inner(x.reshape(-1, shape[-1])).reshape(*shape[:-1], -1)

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tok(TEXT).input_ids])

    def ppl() -> float:
        with torch.no_grad():
            return math.exp(model(ids, labels=ids).loss.item())

    before = ppl()
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and child_name != "down_proj":  # as CausalLM does
                setattr(module, child_name, Int8(child))
    return before, ppl()


def decode_rate(llm, batch: int, max_tokens: int) -> float:
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts(batch), params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench quantization", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--prompts", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=1)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", module="torch.ao")
    from pdserve.engine.llm import LLM

    fp32 = LLM(args.model, num_threads=args.num_threads)
    int8 = LLM(args.model, num_threads=args.num_threads, quantization="int8")
    same, share = agreement(fp32, int8, prompts(args.prompts), args.max_tokens)
    print(f"greedy agreement over {args.prompts} prompts, {args.max_tokens} tokens: {same} identical "
          f"({same / args.prompts:.0%}); mean share before the first difference {share:.1%}", flush=True)
    before, after = perplexities(fp32.engine.loaded.model_dir)
    print(f"perplexity of a fixed {len(TEXT.split())}-word text: fp32 {before:.3f}, int8 {after:.3f} "
          f"({after / before - 1:+.1%})", flush=True)
    rates = {"fp32": [], "int8": []}
    for _ in range(args.rounds):
        for name, llm in (("fp32", fp32), ("int8", int8)):
            rates[name].append(decode_rate(llm, args.batch, 64))
    best = {name: max(r) for name, r in rates.items()}
    print(f"decode at batch {args.batch}, 64 tokens, best of {args.rounds}: fp32 {best['fp32']:.1f} tok/s, "
          f"int8 {best['int8']:.1f} tok/s, ratio {best['int8'] / best['fp32']:.2f}", flush=True)
    fp32.engine.assert_no_leaks()
    int8.engine.assert_no_leaks()
    return 0

"""Constrained decoding cost, printed side by side in one run.

1. Grammar libraries: the per-token cost (mask + advance) of llguidance and xgrammar
   (when installed) walking the same JSON answer with the model's tokenizer.
2. The engine: decode throughput of 8 concurrent requests with and without a JSON-schema
   constraint (tokens per second, best of `rounds`), and their ratio. The schema's summary
   is too long to close within max_tokens, so both runs generate the same number of tokens.

Run: pdserve bench constrained [--rounds 3] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import time

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 400}, "summary": {"type": "string", "minLength": 300, "maxLength": 400},
    "year": {"type": "integer"}}, "required": ["title", "summary", "year"], "additionalProperties": False}
ANSWER = json.dumps({"title": "A long walk through the forest at night", "summary": "x " * 160, "year": 1999},
                    separators=(",", ":"))


def _llguidance_ms(tokenizer, vocab_size: int, eos, ids: list[int]) -> float:
    from pdserve.engine.constraints import Constraint, GrammarCompiler

    matcher = GrammarCompiler(tokenizer, vocab_size, eos).matcher(Constraint("json_schema", json.dumps(SCHEMA)))
    start = time.perf_counter()
    for token in ids:
        assert bool(matcher.allowed()[token])
        matcher.advance(token)
    return (time.perf_counter() - start) * 1000 / len(ids)


def _xgrammar_ms(tokenizer, vocab_size: int, ids: list[int]) -> float | None:
    try:
        import torch
        import xgrammar
    except ImportError:
        return None
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                                separators=(",", ":"))
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    logits = torch.zeros(1, vocab_size)
    start = time.perf_counter()
    for token in ids:
        matcher.fill_next_token_bitmask(bitmask)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask)  # the same work as our masked_fill
        assert matcher.accept_token(token)
    return (time.perf_counter() - start) * 1000 / len(ids)


def _throughput(llm, prompts, params) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == params.max_tokens for o in outs), "a request ended early"
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="pdserve bench constrained", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    args = parser.parse_args(argv)
    from pdserve.engine.constraints import Constraint
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    llm = LLM("default", num_blocks=256, num_threads=args.threads)
    tok, cfg = llm.tokenizer, llm.engine.model_config
    ids = tok.encode(ANSWER, add_special_tokens=False)
    print(f"per-token grammar cost, {len(ids)} tokens of a JSON answer, vocab {cfg.vocab_size}:")
    print(f"  llguidance  {_llguidance_ms(tok, cfg.vocab_size, cfg.eos_token_ids, ids):.3f} ms")
    xg = _xgrammar_ms(tok, cfg.vocab_size, ids)
    print(f"  xgrammar    {xg:.3f} ms" if xg is not None else "  xgrammar    not installed")
    prompts = [f"<|im_start|>user\nDescribe book number {i} as JSON.<|im_end|>\n<|im_start|>assistant\n"
               for i in range(args.concurrency)]
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    bound = SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                           constraint=Constraint("json_schema", json.dumps(SCHEMA)))
    _throughput(llm, prompts, free)  # warm-up
    _throughput(llm, prompts, bound)
    best_free = best_bound = 0.0
    for _ in range(args.rounds):  # interleaved, so a noisy neighbour hurts both alike
        best_free = max(best_free, _throughput(llm, prompts, free))
        best_bound = max(best_bound, _throughput(llm, prompts, bound))
    print(f"decode throughput, {args.concurrency} concurrent requests, {args.max_tokens} tokens, best of {args.rounds}:")
    print(f"  unconstrained {best_free:8.1f} tok/s")
    print(f"  json_schema   {best_bound:8.1f} tok/s   ratio {best_bound / best_free:.3f}")
    llm.engine.assert_no_leaks()


if __name__ == "__main__":
    main()

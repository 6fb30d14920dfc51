"""Prefill scheduling under a mixed load: `pdserve bench mixed-prefill [--long 2000] ...`.

What a prefill service sees when a short chat arrives just behind a long prompt: both are
prefills (max_tokens 1). For each scheduling config (chunking policy x step token budget)
the engine runs the short prompt alone, then the long one with the short one queued right
behind it, and prints side by side: the short prompt's time to first token solo and behind
the long one (and their ratio), and the long prompt's own time to first token. One engine
per config, stepped in this process; the same random prompts for every config.
"""
from __future__ import annotations

import argparse
import time

CONFIGS = (("FIRST_COME_FIRST_SERVED", 2048), ("EQUAL_PROGRESS", 2048), ("EQUAL_PROGRESS", 512),
           ("EQUAL_PROGRESS", 256), ("EQUAL_PROGRESS", 128), ("EQUAL_PROGRESS", 64),
           ("SHORTEST_FIRST", 512), ("SHORTEST_FIRST", 256))


def _ttfts(engine, prompts: dict[str, list[int]], timeout_s: float) -> dict[str, float]:
    """Add `prompts` in order at once; seconds from then to each one's first token."""
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for rid, ids in prompts.items():
        engine.add_request(ids, params, request_id=rid)
    out: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished():
        if time.monotonic() > deadline:
            raise TimeoutError(f"prefills not done within {timeout_s:g} s")
        deltas, _ = engine.step()
        now = time.perf_counter() - start
        for d in deltas:
            if d.new_token_ids and d.request_id not in out:
                out[d.request_id] = now
    return out


def run_config(model: str, policy: str, budget: int, long_ids, short_ids, threads: int,
               repeats: int, timeout_s: float) -> tuple[float, float, float]:
    """(short solo, short behind long, long) TTFT in seconds, best of `repeats`."""
    from pdserve.engine.config import EngineConfig, SchedulerConfig
    from pdserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, num_threads=threads, scheduler=SchedulerConfig(
        chunking_policy=policy, max_num_tokens=budget)))
    _ttfts(engine, {"warm": short_ids}, timeout_s)
    solo, behind, long = [], [], []
    for i in range(repeats):
        # fresh tokens every time: the warm-up's prefix-cache hit would flatter the solo run
        solo.append(_ttfts(engine, {f"s{i}": [(t + 500 + i) % 1000 + 10 for t in short_ids]}, timeout_s)[f"s{i}"])
        # distinct first tokens: no prefix-cache hit from the previous round
        mixed = _ttfts(engine, {f"l{i}": [(t + i) % 1000 + 10 for t in long_ids],
                                f"b{i}": [(t + i) % 1000 + 10 for t in short_ids]}, timeout_s)
        behind.append(mixed[f"b{i}"])
        long.append(mixed[f"l{i}"])
    engine.assert_no_leaks()
    return min(solo), min(behind), min(long)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench mixed-prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--long", type=int, default=2000, help="tokens of the long prompt")
    p.add_argument("--short", type=int, default=40, help="tokens of the short chat")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--configs", default="",
                   help="POLICY:BUDGET,... (default: " + ",".join(f"{a}:{b}" for a, b in CONFIGS) + ")")
    args = p.parse_args(argv)
    configs = CONFIGS
    if args.configs:
        configs = tuple((c.split(":")[0], int(c.split(":")[1])) for c in args.configs.split(","))
    import random

    rng = random.Random(0)
    long_ids = [rng.randrange(10, 1000) for _ in range(args.long)]
    short_ids = [rng.randrange(10, 1000) for _ in range(args.short)]
    print(f"long {args.long} tokens, short {args.short} tokens, {args.num_threads} thread(s), "
          f"best of {args.repeats}")
    print(f"{'policy':<24} {'budget':>6} {'short solo':>11} {'short behind':>13} {'ratio':>6} {'long':>8}")
    for policy, budget in configs:
        solo, behind, long = run_config(args.model, policy, budget, long_ids, short_ids,
                                        args.num_threads, args.repeats, args.timeout_s)
        print(f"{policy:<24} {budget:>6} {solo * 1000:>9.0f}ms {behind * 1000:>11.0f}ms "
              f"{behind / solo:>6.2f} {long * 1000:>6.0f}ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))

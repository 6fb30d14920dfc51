"""Layer-wise KV streaming: `pdserve bench layerwise [--prompt-len 2000] [--backends ucx nccl]`.

One long prompt handed from a prefill engine to a decode engine, both in this process at
one torch thread (the transports run on their own threads), prefilled in 256-token steps
as the prefill service does. For each backend, with the prompt's KV streamed layer by layer
while it computes and with the whole prompt sent after its forward (PDSERVE_KV_LAYERWISE=0),
interleaved run by run, it prints:

* prefill: the prompt's forward (from adding the request to the step that ends it);
* tail: from the end of that forward to the decode holding every block verified;
* layer send: a stream's mean time to send one message (one layer of one step's blocks),
  and tail / layer send (the aim: at most 2);
* TTFT: adding the prefill request to the decode's first token, against the decode engine
  prefilling the prompt itself (`--local-prefill`, the same step budget and thread count);
* first: the first hand-off of each engine pair's tail, against the median of the rest (a
  cold connection shows here).

Greedy tokens are checked against the local run, and both pools for leaked blocks.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

from pdserve.kvtransfer.config import TRANSPORTS


@dataclass
class Row:
    backend: str
    layerwise: bool
    prefill_s: list[float] = field(default_factory=list)
    tail_s: list[float] = field(default_factory=list)
    layer_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    messages: int = 0


def _run_until(engine, done, timeout_s: float) -> list:
    deadline = time.monotonic() + timeout_s
    outputs = []
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine did not finish within {timeout_s:g} s")
        outputs += engine.step()[0]
    return outputs


class Pair:
    """A prefill engine and a decode engine joined by one transfer backend."""

    def __init__(self, loaded, backend: str, layerwise: bool, args) -> None:
        from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
        from pdserve.engine.llm_engine import LLMEngine
        from pdserve.kvtransfer import KVTransferConfig, connector_factory
        from pdserve.kvtransfer.verdict import RECOMPUTE

        transfer = KVTransferConfig(backends=(backend, RECOMPUTE), layerwise=layerwise)
        config = EngineConfig(model=args.model, num_threads=args.threads,
                              cache=CacheConfig(num_blocks=args.prompt_len // 16 + 64),
                              scheduler=SchedulerConfig(chunking_policy="EQUAL_PROGRESS",
                                                        max_num_tokens=args.step_tokens))
        self.config = config
        self.prefill = LLMEngine(config, connector=connector_factory(transfer, listen=False), loaded=loaded)
        self.decode = LLMEngine(config, connector=connector_factory(transfer), loaded=loaded)
        self.timeout_s = args.timeout_s

    def hand_off(self, prompt: list[int], rid: str):
        """(tokens, prefill s, verdict, TTFT s) of one disaggregated request."""
        from pdserve.engine.sampling_params import SamplingParams
        from pdserve.kvtransfer import ReceiveParams
        from pdserve.kvtransfer.codec import new_transfer_id

        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        tid = new_transfer_id()
        self.decode.add_request(prompt, greedy, request_id=rid, remote_prefill=True,
                                transfer_params=ReceiveParams(tid))
        waiting: list = []
        deadline = time.monotonic() + self.timeout_s
        while not waiting:
            if time.monotonic() > deadline:
                raise TimeoutError("the decode engine never asked for a prefill")
            waiting += self.decode.step()[1]
        receives = self.decode.connector.receives
        leading = max(0, waiting[0].num_cached_tokens) // receives.block_size
        params = receives.prepare_receive(rid, self.decode.remote_block_ids(rid), len(prompt), leading,
                                          time.time() + self.timeout_s, tid)
        start = time.perf_counter()
        self.prefill.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                                 request_id=f"p-{rid}", transfer_params=params)
        outs = _run_until(self.prefill, lambda: not self.prefill.has_unfinished(), self.timeout_s)
        prefill_s = time.perf_counter() - start
        first = [t for o in outs for t in o.new_token_ids]
        verdict = self.prefill.connector.sends.wait_verdict(f"p-{rid}", self.timeout_s)
        if verdict is None:
            raise TimeoutError("no transfer verdict")
        received = receives.complete_receive(rid, verdict)
        if not received.ok:
            raise RuntimeError(f"the transfer failed: {received.describe()}")
        self.decode.finish_remote_prefill(rid, first[0])
        outs = self.decode.step()[0]
        ttft_s = time.perf_counter() - start
        outs += _run_until(self.decode, lambda: not self.decode.has_unfinished(), self.timeout_s)
        tokens = [t for o in outs if o.request_id == rid for t in o.new_token_ids]
        return tokens, prefill_s, verdict, ttft_s

    def assert_no_leaks(self) -> None:
        self.prefill.assert_no_leaks()
        self.decode.assert_no_leaks()

    def close(self) -> None:
        self.prefill.connector.worker.close()
        self.decode.connector.worker.close()


def local_prefill(engine, prompt: list[int], rid: str, timeout_s: float) -> tuple[list[int], float]:
    """The decode engine computing the prompt itself: (tokens, TTFT s)."""
    from pdserve.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), request_id=rid)
    tokens, ttft = [], None
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished():
        if time.monotonic() > deadline:
            raise TimeoutError("the local prefill did not finish")
        for out in engine.step()[0]:
            if out.new_token_ids and ttft is None:
                ttft = time.perf_counter() - start
            tokens += out.new_token_ids
    return tokens, ttft


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:>9.1f}" if values else f"{'-':>9}"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench layerwise", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--backends", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    p.add_argument("--threads", type=int, default=1, help="torch threads of each engine")
    p.add_argument("--step-tokens", type=int, default=256, help="the prefill's step budget")
    p.add_argument("--repeats", type=int, default=3, help="hand-offs per configuration")
    p.add_argument("--timeout-s", type=float, default=300.0)
    args = p.parse_args(argv)

    import random

    import torch

    from pdserve.engine.loader import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    rng = random.Random(0)
    top = min(1000, loaded.model_config.vocab_size)
    prompts = [[rng.randrange(3, top) for _ in range(args.prompt_len)] for _ in range(args.repeats)]
    pairs = {(b, lw): Pair(loaded, b, lw, args) for b in args.backends for lw in (True, False)}
    rows = {key: Row(*key) for key in pairs}
    local_ttft: list[float] = []
    firsts: dict[tuple[str, bool], float] = {}
    from pdserve.engine.llm_engine import LLMEngine

    reference = LLMEngine(next(iter(pairs.values())).config, loaded=loaded)  # --local-prefill
    try:
        for i, prompt in enumerate(prompts):
            expected, ttft = local_prefill(reference, prompt, f"local-{i}", args.timeout_s)
            local_ttft.append(ttft)
            for key, pair in pairs.items():  # interleaved: each configuration once per round
                tokens, prefill_s, verdict, ttft_s = pair.hand_off(prompt, f"r{i}")
                if tokens != expected:
                    raise AssertionError(f"{key}: greedy tokens {tokens} != local {expected}")
                row = rows[key]
                if i == 0:
                    firsts[key] = verdict.tail_s
                row.prefill_s.append(prefill_s)
                row.tail_s.append(verdict.tail_s)
                row.ttft_s.append(ttft_s)
                if verdict.num_messages:
                    row.layer_s.append(verdict.layer_send_s)
                    row.messages = verdict.num_messages
        for pair in pairs.values():
            pair.assert_no_leaks()
        reference.assert_no_leaks()
    finally:
        for pair in pairs.values():
            pair.close()
    local = statistics.median(local_ttft)
    print(f"{args.prompt_len}-token prompt, {args.step_tokens}-token prefill steps, {args.threads} thread(s) "
          f"per engine, median of {args.repeats}; local prefill TTFT {local * 1000:.0f} ms")
    print(f"{'backend':<8} {'send':<10} {'prefill ms':>10} {'tail ms':>9} {'layer ms':>9} {'tail/layer':>10} "
          f"{'msgs':>5} {'TTFT ms':>9} {'vs local':>8} {'first tail':>10}")
    for (backend, layerwise), row in rows.items():
        tail = statistics.median(row.tail_s)
        layer = statistics.median(row.layer_s) if row.layer_s else 0.0
        ratio = f"{tail / layer:>10.2f}" if layer else f"{'-':>10}"
        steady = statistics.median(row.tail_s[1:]) if len(row.tail_s) > 1 else tail
        print(f"{backend:<8} {'layerwise' if layerwise else 'whole':<10} {_ms(row.prefill_s):>10} {_ms(row.tail_s)} "
              f"{_ms(row.layer_s)} {ratio} {row.messages:>5} {_ms(row.ttft_s)} "
              f"{statistics.median(row.ttft_s) / local:>8.2f} {firsts[(backend, layerwise)] / max(steady, 1e-9):>9.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))

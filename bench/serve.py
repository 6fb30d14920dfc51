"""`pdserve bench serve`: load an OpenAI-compatible endpoint and measure it.

Arrivals are open-loop (Poisson or evenly spaced at a request rate; `inf` sends all at
once) or closed-loop (a fixed number of requests always in flight). `--request-rates
1,2,4` (or `--concurrency 1,4,16`) sweeps in one call; run k of a sweep sends requests
k*N .. k*N+N-1 of the workload, so no run replays another's prompts. Every run is
bounded by its number of requests, an optional duration after which nothing new is sent,
and the per-request timeout.

    pdserve bench serve --base-url http://127.0.0.1:8000/v1 --request-rates 1,2,4 \\
        --input-len 1000-2000 --output-len 128 --num-requests 50 --out-dir results/
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from pdserve.bench.cli import HelpFormatter
from pdserve.bench.report import (
    BenchRun,
    RequestResult,
    Slo,
    format_speculation,
    format_table,
    format_text_agreement,
    plot_against_load,
    plot_latency_cdfs,
    summarize,
    write_json,
)
from pdserve.bench.stream import ENDPOINTS, Endpoint, OpenAIStreamClient
from pdserve.bench.workload import (
    BenchConfigError,
    BenchRequest,
    CopyWorkload,
    RequestClass,
    SyntheticWorkload,
    Workload,
    load_dataset,
    parse_length,
    parse_mix,
)

ARRIVALS = ("poisson", "fixed", "closed")
WARMUP_FIRST_INDEX = 10**9  # warm-up requests come from an index range no run uses


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """How requests arrive: `loads` are request rates (req/s, inf allowed) for poisson and
    fixed, concurrencies for closed; one run per load."""

    arrival: str = "poisson"
    loads: tuple[float, ...] = (1.0,)
    num_requests: int = 100  # per run
    duration_s: float | None = None  # per run: nothing new is sent after this
    max_concurrency: int | None = None  # open loop: cap on requests in flight
    warmup_requests: int = 0  # sent one at a time before the first run, not measured
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise BenchConfigError(f"arrival {self.arrival!r}: expected one of {ARRIVALS}")
        if not self.loads or any(not (load > 0) for load in self.loads):
            raise BenchConfigError("request rates / concurrencies must be > 0")
        if self.arrival == "closed" and any(not math.isfinite(c) or c != int(c) for c in self.loads):
            raise BenchConfigError("concurrencies must be whole numbers")
        if self.num_requests < 1:
            raise BenchConfigError("num_requests must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise BenchConfigError("duration must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchConfigError("max concurrency must be >= 1")
        if self.warmup_requests < 0:
            raise BenchConfigError("warmup requests must be >= 0")

    def label(self, load: float) -> str:
        if self.arrival == "closed":
            return f"concurrency={int(load)}"
        return f"rate={load:g}"


def arrival_offsets(arrival: str, rate: float, count: int, rng: random.Random) -> list[float]:
    """Send times (s after the run starts) of `count` open-loop requests at `rate` req/s."""
    if math.isinf(rate):
        return [0.0] * count
    if arrival == "fixed":
        return [i / rate for i in range(count)]
    offsets, t = [], 0.0
    for _ in range(count):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


class _Progress:
    """tqdm when asked for, a no-op otherwise (no `if bar is not None` at the call sites)."""

    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=True)

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def _open_loop(client: OpenAIStreamClient, plan: LoadPlan,
                     requests: Sequence[BenchRequest], offsets: Sequence[float],
                     progress: _Progress) -> list[RequestResult]:
    limit = asyncio.Semaphore(plan.max_concurrency or len(requests) or 1)
    start = time.perf_counter()

    async def one(req: BenchRequest) -> RequestResult:
        async with limit:
            result = await client.send(req, start)
        progress.update()
        return result

    tasks = []
    for req, offset in zip(requests, offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    return list(await asyncio.gather(*tasks))


async def _closed_loop(client: OpenAIStreamClient, plan: LoadPlan, concurrency: int,
                       requests: Sequence[BenchRequest], progress: _Progress) -> list[RequestResult]:
    pending = iter(requests)
    results: list[RequestResult] = []
    start = time.perf_counter()

    async def worker() -> None:
        # Single-threaded event loop: next() between awaits hands each request out once.
        for req in pending:
            if plan.duration_s is not None and time.perf_counter() - start > plan.duration_s:
                return
            results.append(await client.send(req, start))
            progress.update()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(results, key=lambda r: r.index)


async def run_load(client: OpenAIStreamClient, plan: LoadPlan, load: float,
                   requests: Sequence[BenchRequest], slo: Slo, run_index: int = 0,
                   progress: bool = False) -> BenchRun:
    """One run of the sweep: send `requests` at `load`, then summarize."""
    label = plan.label(load)
    offsets: list[float] = []
    if plan.arrival != "closed":
        rng = random.Random(f"pdserve-arrivals:{plan.seed}:{run_index}")
        offsets = arrival_offsets(plan.arrival, load, len(requests), rng)
        if plan.duration_s is not None:  # arrivals after the duration are never sent
            offsets = [t for t in offsets if t <= plan.duration_s]
            requests = requests[:len(offsets)]
    bar = _Progress(progress, len(requests), label)
    started = time.perf_counter()
    try:
        if plan.arrival == "closed":
            results = await _closed_loop(client, plan, int(load), requests, bar)
        else:
            results = await _open_loop(client, plan, requests, offsets, bar)
    finally:
        bar.close()
    duration = time.perf_counter() - started
    summary = summarize(label, plan.arrival, load, results, duration, slo)
    return BenchRun(summary, tuple(results))


async def warm_up(client: OpenAIStreamClient, workload: Workload, count: int) -> int:
    """Send `count` unmeasured requests one at a time; returns how many failed."""
    failed = 0
    for req in workload.requests(WARMUP_FIRST_INDEX, count):
        failed += not (await client.send(req, time.perf_counter())).success
    return failed


async def run_benchmark(endpoint: Endpoint, plan: LoadPlan, workload: Workload, slo: Slo,
                        progress: bool = False) -> tuple[str, list[BenchRun]]:
    """Every run of `plan` against `endpoint`; returns (model used, runs)."""
    (model, runs), = await run_side_by_side([endpoint], plan, workload, slo, progress)
    return model, runs


async def run_side_by_side(endpoints: Sequence[Endpoint], plan: LoadPlan, workload: Workload, slo: Slo,
                           progress: bool = False, rounds: int = 1,
                           on_round: Callable[[int, int, list[BenchRun]], None] | None = None,
                           ) -> list[tuple[str, list[BenchRun]]]:
    """Every run of `plan` against each endpoint: at each load the same requests go to one
    endpoint after the other, so both see the machine in the same state. With `rounds` > 1
    each load runs that many times on fresh requests, the endpoints taking turns at going
    first (so that an effect of the order shows apart from a difference between the
    servers), and each endpoint's rounds are pooled into one run: their requests together
    over their summed time. `on_round(load index, round, runs in endpoint order)` sees each round. Returns
    (model used, runs) per endpoint, in order."""
    if rounds < 1:
        raise BenchConfigError("rounds must be >= 1")
    max_connections = max(64, int(max((x for x in plan.loads if math.isfinite(x)), default=0)),
                          plan.num_requests if plan.arrival != "closed" else 0)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(OpenAIStreamClient(e, max_connections=max_connections))
                   for e in endpoints]
        models = [await client.ensure_model() for client in clients]
        if plan.warmup_requests:
            for client in clients:
                failed = await warm_up(client, workload, plan.warmup_requests)
                if failed:
                    print(f"bench serve: {failed}/{plan.warmup_requests} warm-up requests failed "
                          f"at {client.endpoint.base_url}", file=sys.stderr)
        runs: list[list[BenchRun]] = [[] for _ in clients]
        for k, load in enumerate(plan.loads):
            per_round: list[list[BenchRun]] = [[] for _ in clients]
            for r in range(rounds):
                requests = workload.requests((k * rounds + r) * plan.num_requests, plan.num_requests)
                order = list(range(len(clients)))[::-1 if r % 2 else 1]
                done: dict[int, BenchRun] = {}
                for i in order:
                    done[i] = await run_load(clients[i], plan, load, requests, slo, k * rounds + r, progress)
                for i, run in done.items():
                    per_round[i].append(run)
                if on_round is not None:
                    on_round(k, r, [done[i] for i in range(len(clients))])
            for out, mine in zip(runs, per_round):
                out.append(mine[0] if rounds == 1 else pool_runs(mine, slo))
        return list(zip(models, runs))


def pool_runs(runs: Sequence[BenchRun], slo: Slo) -> BenchRun:
    """Rounds of one load as one run: every request of each, over their summed durations."""
    first = runs[0].summary
    results = tuple(r for run in runs for r in run.results)
    duration = sum(run.summary.duration_s for run in runs)
    return BenchRun(summarize(first.label, first.arrival, first.load, results, duration, slo), results)


def _print_round(load_index: int, round_index: int, runs: list[BenchRun]) -> None:
    a, b = (run.summary for run in runs)
    first = "first" if round_index % 2 == 0 else "second"
    ratio = f"{a.output_throughput / b.output_throughput:.2f}x" if b.output_throughput else "-"
    print(f"{a.label} round {round_index + 1} (base URL {first}): out tok/s {a.output_throughput:.1f} vs "
          f"{b.output_throughput:.1f} ({ratio})", flush=True)


def format_ratios(label_a: str, a: Sequence[BenchRun], label_b: str, b: Sequence[BenchRun]) -> str:
    """Per load: output throughput and goodput of `a` over `b` (> 1: `a` serves more), TTFT and
    TPOT p50/p99 of `b` over `a` (> 1: `a` is faster)."""
    def ratio(x: float | None, y: float | None) -> str:
        return f"{x / y:.2f}x" if x and y else "-"

    rows = [f"ratios, {label_a} vs {label_b} (> 1: {label_a} better)",
            f"{'load':>14} {'out tok/s':>10} {'goodput':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}"]
    for ra, rb in zip(a, b):
        sa, sb = ra.summary, rb.summary
        rows.append(f"{sa.label:>14} {ratio(sa.output_throughput, sb.output_throughput):>10} "
                    f"{ratio(sa.goodput, sb.goodput):>8} {ratio(sb.ttft.p50_ms, sa.ttft.p50_ms):>9} "
                    f"{ratio(sb.ttft.p99_ms, sa.ttft.p99_ms):>9} {ratio(sb.tpot.p50_ms, sa.tpot.p50_ms):>9} "
                    f"{ratio(sb.tpot.p99_ms, sa.tpot.p99_ms):>9}")
    return "\n".join(rows)


@dataclass(frozen=True, slots=True)
class ServeSettings:
    """Everything one `bench serve` call was asked to do; written at the top of the JSON."""

    endpoint: Endpoint
    plan: LoadPlan
    slo: Slo
    workload: str  # human description: the mix or the dataset path


def write_outputs(out_dir: Path, settings: ServeSettings, runs: Sequence[BenchRun],
                  plots: bool = True) -> list[Path]:
    """serve_results.json, latency_cdf.png and (for a sweep of 2+ finite loads) sweep.png."""
    safe = dataclasses.replace(settings, endpoint=dataclasses.replace(
        settings.endpoint, api_key="***" if settings.endpoint.api_key else None))
    written = [write_json(out_dir / "serve_results.json", safe, runs)]
    if plots and runs:
        written.append(plot_latency_cdfs(runs, out_dir / "latency_cdf.png"))
        if sum(math.isfinite(r.summary.load) for r in runs) >= 2:
            written.append(plot_against_load({"": [r.summary for r in runs]},
                                             out_dir / "sweep.png", "bench serve sweep"))
    return written


def write_trace_of(path: str | Path, runs: Sequence[BenchRun]) -> Path:
    """The requests of `runs` as `pdserve plan` reads a trace: each run's send times after the
    previous runs' durations; prompt tokens as the server counted them (else the target), the
    tokens it generated. Requests that generated nothing are left out."""
    from pdserve.planner.workload import TraceRequest, write_trace

    out, offset = [], 0.0
    for run in runs:
        for r in run.results:
            prompt = r.prompt_tokens or r.target_input_tokens
            if prompt and r.output_tokens > 0:
                out.append(TraceRequest(offset + r.start_s, prompt, r.output_tokens))
        offset += run.summary.duration_s
    return write_trace(path, out)


# ---------------------------------------------------------------- CLI


def _float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers separated by commas") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one value")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench serve",
                                description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    g = p.add_argument_group("endpoint")
    g.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    g.add_argument("--model", help="model name in requests (default: the first of /models); a comma list "
                                    "(a base model and LoRA adapters) is used in turn, request by request")
    g.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="chat")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", default="{}",
                   help='JSON object merged into each request, e.g. \'{"ignore_eos": true}\'')
    g.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos: true (pdserve, vLLM, SGLang) so outputs run to max_tokens")
    g.add_argument("--request-timeout-s", type=float, default=300.0)
    g.add_argument("--compare-url", help="a second OpenAI-compatible server: the same requests go to it at "
                                         "each load, right after --base-url, and the ratios are printed")
    g.add_argument("--compare-model", help="model name there (default: the first of its /models)")
    g.add_argument("--compare-api-key", help="its key (default: none; --api-key is never sent to it)")
    g.add_argument("--rounds", type=int, default=1,
                   help="with --compare-url: run each load this many times on fresh requests, the two "
                        "servers taking turns at going first (an effect of the order then shows apart "
                        "from a difference between them), and pool each server's rounds")
    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rates", type=_float_list,
                   help="open loop: req/s, comma separated, 'inf' = all at once (default 1)")
    a.add_argument("--arrival", choices=("poisson", "fixed"), default="poisson",
                   help="open-loop inter-arrival times")
    a.add_argument("--concurrency", type=_float_list,
                   help="closed loop instead: requests in flight, comma separated")
    a.add_argument("--max-concurrency", type=int, help="open loop: cap on requests in flight")
    a.add_argument("--num-requests", type=int, default=100, help="per run")
    a.add_argument("--duration-s", type=float, help="per run: send nothing new after this")
    a.add_argument("--warmup-requests", type=int, default=0)
    a.add_argument("--seed", type=int, default=0)
    w = p.add_argument_group("workload")
    w.add_argument("--input-len", default="256", help="N, LOW-HIGH or normal(MEAN,STD[,LOW,HIGH])")
    w.add_argument("--output-len", default="128", help="max_tokens: same forms as --input-len")
    w.add_argument("--mix", action="append", metavar="NAME:WEIGHT:INPUT:OUTPUT",
                   help="a request class (repeat for a mix; replaces --input-len/--output-len)")
    w.add_argument("--dataset", help="JSONL of {'messages': [...], 'max_tokens': N} per line")
    w.add_argument("--workload", choices=("random", "copy", "multiturn"), default="random",
                   help="random words, or prompts whose answers quote them (repeat, extract, rename a "
                        "variable: what speculative decoding is for; --input-len is the quoted text's words), "
                        "or chats that come back (bench.multiturn: --sessions, --turns, --think-time-s, "
                        "--system-len, --turn-len; --output-len is each answer's max_tokens)")
    m = p.add_argument_group("multiturn workload")
    m.add_argument("--sessions", type=int, default=8, help="chats run at once")
    m.add_argument("--turns", type=int, default=4, help="turns per chat")
    m.add_argument("--think-time-s", type=float, default=1.0,
                   help="mean pause before each later turn (uniform over 0.5x-1.5x)")
    m.add_argument("--system-len", default="400-600", help="words of each chat's system message")
    m.add_argument("--turn-len", default="16-48", help="words of each user message")
    m.add_argument("--block-size", type=int, default=16,
                   help="the server's KV block size: a turn's whole history counts as cached at "
                        "the previous prompt plus answer less one block")
    o = p.add_argument_group("output")
    o.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    o.add_argument("--slo-tpot-ms", type=float, default=100.0)
    o.add_argument("--out-dir", help="write serve_results.json and PNG plots here")
    o.add_argument("--trace-out", help="record the requests sent as a trace for `pdserve plan --trace` "
                                       "(JSON lines: arrival_s, input_len, output_len; runs one after another)")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    return p


def settings_from_args(args: argparse.Namespace) -> tuple[ServeSettings, Workload]:
    if args.request_rates is not None and args.concurrency is not None:
        raise BenchConfigError("give --request-rates or --concurrency, not both")
    if args.concurrency is not None:
        arrival, loads = "closed", args.concurrency
    else:
        arrival, loads = args.arrival, args.request_rates or (1.0,)
    plan = LoadPlan(arrival=arrival, loads=loads, num_requests=args.num_requests,
                    duration_s=args.duration_s, max_concurrency=args.max_concurrency,
                    warmup_requests=args.warmup_requests, seed=args.seed)
    endpoint = Endpoint(base_url=args.base_url, model=args.model, api_key=args.api_key,
                        kind=args.endpoint, temperature=args.temperature,
                        extra_body_json=args.extra_body, request_timeout_s=args.request_timeout_s)
    if args.ignore_eos:  # Endpoint has checked that the extra body is a JSON object
        extra = {**json.loads(endpoint.extra_body_json), "ignore_eos": True}
        endpoint = dataclasses.replace(endpoint, extra_body_json=json.dumps(extra))
    if not (args.slo_ttft_ms > 0 and args.slo_tpot_ms > 0):
        raise BenchConfigError("SLOs must be > 0 ms")
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    workload: Workload
    if args.dataset:
        if args.mix:
            raise BenchConfigError("give --dataset or --mix, not both")
        workload = load_dataset(args.dataset, parse_length(args.output_len).high)
        description = f"dataset {args.dataset}"
    elif args.workload == "copy":
        if args.mix:
            raise BenchConfigError("give --workload copy or --mix, not both")
        workload = CopyWorkload(parse_length(args.input_len), parse_length(args.output_len), args.seed)
        description = f"copy: text of {args.input_len} words, output {args.output_len}"
    else:
        classes = (parse_mix(args.mix) if args.mix else
                   (RequestClass("default", 1.0, parse_length(args.input_len),
                                 parse_length(args.output_len)),))
        workload = SyntheticWorkload(classes, args.seed)
        description = "; ".join(f"{c.name} x{c.weight:g}: input {c.input_len}, output {c.output_len}"
                                for c in classes)
    return ServeSettings(endpoint, plan, slo, description), workload


def compare_endpoint(args: argparse.Namespace, endpoint):
    """The second server of --compare-url: our requests, its own key only (--compare-api-key;
    none when not given): one server's key is never sent to another."""
    return dataclasses.replace(endpoint, base_url=args.compare_url, model=args.compare_model,
                               api_key=args.compare_api_key or None)


def _multiturn(args: argparse.Namespace) -> int:
    from pdserve.bench.multiturn import main_multiturn, spec_from_args

    spec_from_args(args)  # its own settings first: a --dataset is refused before it is read
    args.workload, args.input_len = "random", "1"  # the shared endpoint settings only
    settings, _ = settings_from_args(args)
    endpoints = [settings.endpoint] + ([compare_endpoint(args, settings.endpoint)] if args.compare_url else [])
    return main_multiturn(args, endpoints)


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        if args.workload == "multiturn":
            return _multiturn(args)
        settings, workload = settings_from_args(args)
        endpoints = [settings.endpoint]
        if args.compare_url:
            endpoints.append(compare_endpoint(args, settings.endpoint))
        if args.rounds > 1 and not args.compare_url:
            raise BenchConfigError("--rounds takes turns between two servers: give --compare-url")
        results = asyncio.run(run_side_by_side(endpoints, settings.plan, workload, settings.slo,
                                               progress=not args.no_progress, rounds=args.rounds,
                                               on_round=_print_round if args.rounds > 1 else None))
    except BenchConfigError as e:
        print(f"pdserve bench serve: {e}", file=sys.stderr)
        return 2
    for k, ((model, runs), endpoint) in enumerate(zip(results, endpoints)):
        shown = dataclasses.replace(settings, endpoint=dataclasses.replace(endpoint, model=model))
        print(f"model {model} at {endpoint.base_url}; workload: {settings.workload}")
        print(format_table([r.summary for r in runs]))
        speculation = format_speculation(endpoint.base_url, runs)
        if speculation:
            print(speculation)
        if args.out_dir:
            out_dir = Path(args.out_dir) / ("compare" if k else "")
            for path in write_outputs(out_dir, shown, runs, plots=not args.no_plots):
                print(f"wrote {path}")
    if args.trace_out:
        print(f"wrote {write_trace_of(args.trace_out, results[0][1])}")
    if len(results) == 2:
        print(format_ratios(endpoints[0].base_url, results[0][1], endpoints[1].base_url, results[1][1]))
        print(format_text_agreement(results[0][1], results[1][1]))
    return 0 if all(any(r.summary.num_succeeded for r in runs) for _, runs in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

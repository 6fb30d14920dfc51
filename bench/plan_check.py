"""`pdserve bench plan-check`: `pdserve plan`'s predictions against `bench serve` on `pdserve up`.

For colocated (`up --local-prefill`) and 1P1D (`up --num-prefill 1 --num-decode 1`), at three
request rates (low, knee, overload: by default 0.3x, 0.8x and 1.5x of the highest rate at which
the profile's simulation of colocated meets the SLO), it starts `pdserve up`, sends `bench
serve`'s random workload (Poisson arrivals, fixed lengths, ignore_eos), and prints for each
(config, rate) the predicted and measured TTFT and TPOT p50/p90 and their ratio, how many of
the ratios are within 20%, then which config the simulation ranks first at each rate against
the one measured best (most goodput). Each prediction simulates the very arrivals `bench serve`
sends in that run (its seeded Poisson offsets, its request count). Afterwards it also reports
the profile's `served_step_s` that would have matched the measurement best (`fit_served_step`)
and writes the rows to `plan_check.json` (what `tests/unit/test_planner_record.py` replays).
Each run sends about `--run-s` seconds of arrivals (at least 4 requests), so the whole check
takes about 2 x (start-up + 3 x (run-s + drain)): under 12 minutes on a 2-core machine with
the defaults. Run it on a quiet machine: its numbers are the record of how far off the
simulator is.

    pdserve profile --out profile.json
    pdserve bench plan-check --profile profile.json --out-dir results/plan-check
    pdserve bench plan-check --profile profile.json --rates 0.05,0.1,0.2 --run-s 20   # a short look
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
from pathlib import Path
from typing import Sequence

from pdserve.bench.cli import HelpFormatter
from pdserve.bench.experiment import _free_ports
from pdserve.bench.launch import LaunchError, ServiceGroup, ServiceSpec, wait_ready
from pdserve.bench.report import BenchRun, Slo as BenchSlo
from pdserve.bench.serve import LoadPlan, arrival_offsets, run_load
from pdserve.bench.stream import Endpoint, OpenAIStreamClient
from pdserve.bench.workload import BenchConfigError, LengthDist, RequestClass, SyntheticWorkload
from pdserve.planner.profile import load_profile
from pdserve.planner.search import Candidate, Evaluation, evaluate, max_goodput
from pdserve.planner.simulator import Deployment
from pdserve.planner.types import Slo
from pdserve.planner.workload import TraceRequest

WITHIN = 0.2  # a prediction within 20% of its measurement counts as right (issue 44)
SERVED_STEP_GRID_S = tuple(i / 1000 for i in range(0, 21))  # what fit_served_step tries

CONFIGS = {"colocated": ("--local-prefill", "--num-decode", "1"),
           "1p1d": ("--num-prefill", "1", "--num-decode", "1")}
READY_TIMEOUT_S = 240.0


def deployment(config: str, cores: int) -> Deployment:
    return Deployment(0 if config == "colocated" else 1, 1, host_cores=cores)


def bench_trace(rate: float, run_index: int, count: int, input_len: int, output_len: int,
                seed: int) -> tuple[TraceRequest, ...]:
    """The arrivals `bench serve` sends in run `run_index` at `rate` (`run_load`'s seeded offsets)."""
    rng = random.Random(f"pdserve-arrivals:{seed}:{run_index}")
    return tuple(TraceRequest(t, input_len, output_len) for t in arrival_offsets("poisson", rate, count, rng))


def predict(profile, config: str, rate: float, run_index: int, num_requests: int, input_len: int,
            output_len: int, slo: Slo, cores: int, seed: int) -> Evaluation:
    """The simulation of exactly what `bench serve` sends in that run, every request counted."""
    d = deployment(config, cores)
    trace = bench_trace(rate, run_index, num_requests, input_len, output_len, seed)
    return evaluate(profile, Candidate(d, 1, d, cores), trace, slo, rate, warmup=0.0)  # as bench serve counts


def default_rates(profile, input_len: int, output_len: int, slo: Slo, cores: int) -> tuple[float, ...]:
    capacity = max_goodput(profile, deployment("colocated", cores), slo, input_len, output_len,
                           num_requests=100, iterations=7)
    if capacity <= 0:
        raise BenchConfigError("the profile's simulation of colocated meets the SLO at no rate: "
                               "give --rates, or looser SLOs")
    return tuple(round(capacity * f, 4) for f in (0.3, 0.8, 1.5))


def measure(config: str, args: argparse.Namespace, rates: Sequence[float], out_dir: Path) -> dict[float, BenchRun]:
    """Start `pdserve up` in `config`, send each rate's run, stop it."""
    http, grpc, registry = _free_ports(3)
    spec = ServiceSpec(config, ("up", *CONFIGS[config], "--model", args.model, "--port", str(http),
                                "--router-grpc-port", str(grpc), "--router-registry-port", str(registry)))
    endpoint = Endpoint(f"http://127.0.0.1:{http}/v1", kind="completions", temperature=0.0,
                        extra_body_json=json.dumps({"ignore_eos": True}), request_timeout_s=600.0)
    workload = SyntheticWorkload((RequestClass("fixed", 1.0, LengthDist("fixed", args.input_len, args.input_len),
                                               LengthDist("fixed", args.output_len, args.output_len)),), args.seed)
    runs: dict[float, BenchRun] = {}
    with ServiceGroup([spec], out_dir / config / "logs") as group:
        print(f"[{config}] {spec.command_line()}", flush=True)
        model = wait_ready(group, endpoint, READY_TIMEOUT_S)
        endpoint = dataclasses.replace(endpoint, model=model)
        for k, rate in enumerate(rates):
            num = num_requests(rate, args.run_s)
            plan = LoadPlan(arrival="poisson", loads=(rate,), num_requests=num, seed=args.seed)
            requests = workload.requests(k * 10_000, num)
            runs[rate] = asyncio.run(_one(endpoint, plan, rate, requests, k, args))
            group.check_alive()
            print(f"[{config}] rate {rate:g}: {runs[rate].summary.num_succeeded}/{num} ok", flush=True)
    return runs


async def _one(endpoint, plan, rate, requests, k, args) -> BenchRun:
    async with OpenAIStreamClient(endpoint, max_connections=64) as client:
        return await run_load(client, plan, rate, requests, BenchSlo(args.slo_ttft_ms, args.slo_tpot_ms), k)


def num_requests(rate: float, run_s: float) -> int:
    return max(4, int(rate * run_s))


def measured_ms(run: BenchRun, which: str, q: int) -> float:
    value = getattr(getattr(run.summary, which), f"p{q}_ms")
    return math.inf if value is None else value


def ratios(predicted: Sequence[float], measured: Sequence[float]) -> list[float]:
    """predicted / measured per metric (nan where either is missing or infinite)."""
    return [p / m if m and math.isfinite(m) and math.isfinite(p) else math.nan for p, m in zip(predicted, measured)]


def within(values: Sequence[float]) -> int:
    return sum(1 for r in values if abs(r - 1) <= WITHIN)


METRICS = (("ttft", 50), ("ttft", 90), ("tpot", 50), ("tpot", 90))


def report(rows: list[tuple[str, float, Evaluation, BenchRun]], slo: Slo) -> str:
    lines = [f"{'config':>10} {'rate':>7} {'metric':>9} {'predicted':>10} {'measured':>10} {'ratio':>6}"]
    all_ratios = []
    for config, rate, pred, run in rows:
        for which, q in METRICS:
            p, m = pred.ms(which, q), measured_ms(run, which, q)
            ratio = ratios([p], [m])[0]
            all_ratios.append(ratio)
            shown = "-" if math.isnan(ratio) else f"{ratio:.2f}"
            lines.append(f"{config:>10} {rate:>7g} {which.upper() + f' p{q}':>9} {p:>10.0f} {m:>10.0f} {shown:>6}")
    lines.append(f"within {WITHIN:.0%}: {within(all_ratios)} of {len(all_ratios)} predictions")
    lines.append("")
    lines.append(f"{'rate':>7} {'predicted best':>15} {'measured best':>14}  (goodput under the SLO, req/s)")
    for rate in dict.fromkeys(r for _, r, _, _ in rows):
        at = [(c, p, run) for c, r, p, run in rows if r == rate]
        best_pred = max(at, key=lambda x: (x[1].goodput_rps, -x[1].slack))
        best_meas = max(at, key=lambda x: (x[2].summary.goodput, -x[2].summary.ttft.p90_ms))
        lines.append(f"{rate:>7g} {best_pred[0]:>15} {best_meas[0]:>14}  "
                     + ", ".join(f"{c} {p.goodput_rps:.3f} vs {run.summary.goodput:.3f}" for c, p, run in at))
    return "\n".join(lines)


def record(rows: list[tuple[str, float, Evaluation, BenchRun]], args: argparse.Namespace, cores: int) -> dict:
    """What the run measured, in the shape `replay` reads: the lengths, the seed, and per
    (config, rate) its run index, request count and the measured p50/p90 in ms."""
    rates = list(dict.fromkeys(r for _, r, _, _ in rows))
    return {"input_len": args.input_len, "output_len": args.output_len, "seed": args.seed, "cores": cores,
            "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
            "runs": [{"config": c, "rate": r, "run_index": rates.index(r), "num_requests": run.summary.num_requests,
                      "num_ok": run.summary.num_succeeded,
                      "measured_ms": {f"{w}_p{q}": _finite(measured_ms(run, w, q)) for w, q in METRICS},
                      "predicted_ms": {f"{w}_p{q}": _finite(pred.ms(w, q)) for w, q in METRICS}}
                     for c, r, pred, run in rows]}


def _finite(value: float) -> float | None:
    return round(value, 3) if math.isfinite(value) else None


def replay(profile, doc: dict) -> list[tuple[str, float, list[float], list[float]]]:
    """Each recorded run simulated again under `profile`: (config, rate, predicted, measured),
    the four metrics in METRICS order, in ms."""
    slo = Slo(doc["slo_ttft_ms"], doc["slo_tpot_ms"])
    out = []
    for run in doc["runs"]:
        pred = predict(profile, run["config"], run["rate"], run["run_index"], run["num_requests"], doc["input_len"],
                       doc["output_len"], slo, doc["cores"], doc["seed"])
        out.append((run["config"], run["rate"], [pred.ms(w, q) for w, q in METRICS],
                    [_number(run["measured_ms"][f"{w}_p{q}"]) for w, q in METRICS]))
    return out


def _number(value) -> float:
    return math.inf if value is None else float(value)


def fit_served_step(profile, doc: dict, grid: Sequence[float] = SERVED_STEP_GRID_S) -> tuple[float, int]:
    """The `served_step_s` (of `grid`) under which most replayed predictions fall
    within 20% of the record, ties to the smallest mean |log ratio|; and that count."""
    def score(seconds: float) -> tuple[int, float]:
        rs = [x for _, _, p, m in replay(dataclasses.replace(profile, served_step_s=seconds), doc)
              for x in ratios(p, m) if math.isfinite(x) and x > 0]
        return within(rs), -sum(abs(math.log(x)) for x in rs) / max(1, len(rs))

    best = max(grid, key=score)
    return best, score(best)[0]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench plan-check", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--profile", required=True, help="this machine's profile (pdserve profile)")
    p.add_argument("--model", default="default")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rates", help="three request rates, comma separated (default: from the profile)")
    p.add_argument("--run-s", type=float, default=60.0, help="seconds of arrivals per run")
    p.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=500.0)
    p.add_argument("--cores", type=int, help="cores of this machine the deployment shares (default: all)")
    p.add_argument("--served-step-ms", type=float,
                   help="what a served worker adds to each engine step (default: the profile's served_step_s)")
    p.add_argument("--configs", default="colocated,1p1d")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="print the rates, the predictions and the commands")
    p.add_argument("--out-dir", default="results/plan-check")
    return p


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        profile = load_profile(args.profile)
        if args.served_step_ms is not None:
            profile = dataclasses.replace(profile, served_step_s=args.served_step_ms / 1000)
        slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
        cores = args.cores or profile.machine.num_cores or 1
        configs = [c for c in args.configs.split(",") if c]
        if not set(configs) <= set(CONFIGS):
            raise BenchConfigError(f"--configs: choose from {', '.join(CONFIGS)}")
        rates = (tuple(float(x) for x in args.rates.split(",")) if args.rates
                 else default_rates(profile, args.input_len, args.output_len, slo, cores))
        predictions = {(c, r): predict(profile, c, r, k, num_requests(r, args.run_s), args.input_len,
                                       args.output_len, slo, cores, args.seed)
                       for c in configs for k, r in enumerate(rates)}
        print(f"rates {', '.join(f'{r:g}' for r in rates)} req/s; input {args.input_len}, output {args.output_len}")
        if args.dry_run:
            for (c, r), e in predictions.items():
                print(f"{c:>10} {r:>7g}: predicted TTFT p50 {e.ms('ttft', 50):.0f} ms p90 {e.ms('ttft', 90):.0f} ms, "
                      f"TPOT p50 {e.ms('tpot', 50):.0f} ms p90 {e.ms('tpot', 90):.0f} ms; "
                      f"pdserve up {' '.join(CONFIGS[c])}")
            return 0
        out_dir = Path(args.out_dir)
        measured = {c: measure(c, args, rates, out_dir) for c in configs}
    except (BenchConfigError, LaunchError, ValueError) as exc:
        print(f"pdserve bench plan-check: {exc}", file=sys.stderr)
        return 2
    rows = [(c, r, predictions[(c, r)], measured[c][r]) for c in configs for r in rates]
    doc = record(rows, args, cores)
    served, count = fit_served_step(profile, doc)
    text = (report(rows, slo) + f"\nserved_step_s {profile.served_step_s * 1000:g} ms; the record fits "
            f"{served * 1000:g} ms best ({count} of {len(rows) * len(METRICS)} within {WITHIN:.0%})")
    print(text)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plan_check.txt").write_text(text + "\n")
    (out_dir / "plan_check.json").write_text(json.dumps({**doc, "served_step_fit_s": served}, indent=1) + "\n")
    return 0

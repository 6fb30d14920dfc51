"""`pdserve bench experiment`: disaggregated against colocated serving on this machine.

Two setups of the same engine on the same two CPU cores, driven by the same workload
(long prompts of 1-2k tokens with 128-token outputs, mixed with short chats) at the same
request rates:

    disaggregated  router + prefill service pinned to core A + decode service pinned to
                   core B, one thread each; decode never prefills itself (thresholds 0 /
                   unreachable), so every prompt crosses the KV transfer layer
    colocated      router + one decode service on both cores with two threads that
                   prefills every prompt itself (local-prefill threshold unreachable)

For each rate it prints TTFT p99, TPOT p99 and goodput for both setups and their ratios,
then the headline numbers of the issue: the TPOT p99 ratio at the highest rate where
colocated still meets the TTFT SLO on p99, and the ratio of the best goodputs. Results go
to OUT/<setup>/serve_results.json (+ CDF plots) and OUT/experiment.json + experiment.png.

    pdserve bench experiment --dry-run        # print the commands, start nothing
    pdserve bench experiment --rates 0.1,0.2,0.4 --out-dir results/experiment
    pdserve bench experiment --analyze-only --out-dir results/experiment
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import shlex
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pdserve.bench.cli import HelpFormatter
from pdserve.bench.comparison import SETUPS, write_analysis
from pdserve.bench.launch import LaunchError, ServiceGroup, ServiceSpec, wait_ready
from pdserve.bench.report import RunSummary, Slo, format_table, load_summaries
from pdserve.bench.serve import LoadPlan, ServeSettings, run_benchmark, write_outputs
from pdserve.bench.stream import Endpoint
from pdserve.bench.workload import BenchConfigError, SyntheticWorkload, parse_mix

NEVER = 1 << 30  # a local-prefill threshold no prompt or queue reaches


# ---------------------------------------------------------------- plans


@dataclass(frozen=True, slots=True)
class Ports:
    http: int
    router_grpc: int
    router_registry: int
    prefill_grpc: int
    decode_grpc: int
    prefill_transfer: int
    decode_transfer: int

    @classmethod
    def pick(cls) -> "Ports":
        return cls(*_free_ports(7))


@dataclass(frozen=True, slots=True)
class ServiceOptions:
    """What both setups share: the engine and the extra flags of each role."""

    model: str = "default"
    device: str = "cpu"
    cores: tuple[int, int] = (0, 1)
    kv_backends: str | None = None
    log_level: str | None = None
    router_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SetupPlan:
    name: str
    services: tuple[ServiceSpec, ...]
    base_url: str


def _engine_args(opts: ServiceOptions, num_threads: int) -> list[str]:
    args = ["--model", opts.model, "--device", opts.device, "--num-threads", str(num_threads)]
    if opts.log_level:
        args += ["--log-level", opts.log_level]
    return args


def _router(opts: ServiceOptions, ports: Ports, local_prefill_threshold: int,
            prefill_queue_threshold: int) -> ServiceSpec:
    args = ["router", "--http-port", str(ports.http), "--grpc-port", str(ports.router_grpc),
            "--registry-port", str(ports.router_registry),
            "--local-prefill-threshold", str(local_prefill_threshold),
            "--prefill-queue-threshold", str(prefill_queue_threshold)]
    if opts.log_level:
        args += ["--log-level", opts.log_level]
    return ServiceSpec("router", (*args, *opts.router_args))  # not pinned: it moves no KV


def plan_setup(name: str, opts: ServiceOptions, ports: Ports) -> SetupPlan:
    """The processes of one setup. Every flag used here is one of deploy/cli.py's."""
    router_addr = f"127.0.0.1:{ports.router_registry}"
    backends = ["--kv-backends", opts.kv_backends] if opts.kv_backends else []
    if name == "disaggregated":
        prefill = ServiceSpec("prefill", (
            "prefill", *_engine_args(opts, 1), "--grpc-port", str(ports.prefill_grpc),
            "--transfer-port", str(ports.prefill_transfer), "--router", router_addr,
            *backends, *opts.prefill_args), cpus=(opts.cores[0],), num_threads=1)
        decode = ServiceSpec("decode", (
            "decode", *_engine_args(opts, 1), "--grpc-port", str(ports.decode_grpc),
            "--transfer-port", str(ports.decode_transfer), "--router", router_addr,
            *backends, *opts.decode_args), cpus=(opts.cores[1],), num_threads=1)
        services = (_router(opts, ports, 0, NEVER), prefill, decode)
    elif name == "colocated":
        decode = ServiceSpec("decode", (
            "decode", *_engine_args(opts, 2), "--grpc-port", str(ports.decode_grpc),
            "--transfer-port", str(ports.decode_transfer), "--router", router_addr,
            *backends, *opts.decode_args), cpus=tuple(opts.cores), num_threads=2)
        services = (_router(opts, ports, NEVER, NEVER), decode)
    else:
        raise BenchConfigError(f"setup {name!r}: expected one of {SETUPS}")
    return SetupPlan(name, services, f"http://127.0.0.1:{ports.http}/v1")


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in socks:  # hold all open at once so the ports are distinct
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# ---------------------------------------------------------------- running


def run_setup(plan: SetupPlan, settings: ServeSettings, workload: SyntheticWorkload,
              out_dir: Path, ready_timeout_s: float, progress: bool) -> list[RunSummary]:
    """Start the setup's services, benchmark them, stop them; writes OUT/<setup>/."""
    setup_dir = out_dir / plan.name
    endpoint = dataclasses.replace(settings.endpoint, base_url=plan.base_url, api_key=None)
    with ServiceGroup(plan.services, setup_dir / "logs") as group:
        print(f"[{plan.name}] starting {', '.join(s.name for s in plan.services)}; "
              f"logs in {setup_dir / 'logs'}", flush=True)
        model = wait_ready(group, endpoint, ready_timeout_s)
        print(f"[{plan.name}] ready (model {model})", flush=True)
        endpoint = dataclasses.replace(endpoint, model=model)
        _, runs = asyncio.run(run_benchmark(endpoint, settings.plan, workload, settings.slo,
                                            progress=progress))
        group.check_alive()  # a service that died mid-run makes the numbers meaningless
    write_outputs(setup_dir, dataclasses.replace(settings, endpoint=endpoint), runs)
    return [r.summary for r in runs]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench experiment",
                                description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--setups", default=",".join(SETUPS), help="which setups to run, comma separated")
    p.add_argument("--rates", default="0.1,0.2,0.4", help="request rates (req/s), comma separated")
    p.add_argument("--arrival", choices=("poisson", "fixed"), default="poisson")
    p.add_argument("--num-requests", type=int, default=30, help="per rate")
    p.add_argument("--duration-s", type=float, default=180.0, help="per rate: send nothing new after")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--warmup-requests", type=int, default=2, help="per setup, unmeasured")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mix", action="append", metavar="NAME:WEIGHT:INPUT:OUTPUT",
                   help="request classes (default: long:1:1000-2000:128 and chat:3:16-128:32-128)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--extra-body", default='{"ignore_eos": true}',
                   help="JSON merged into every request (default: outputs run to max_tokens)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cores", help="two CPU ids: prefill's core, decode's core "
                                   "(default: the first two this process may use)")
    p.add_argument("--kv-backends", help="transfer fallback chain for both services")
    p.add_argument("--log-level")
    p.add_argument("--router-args", default="", help="extra router flags (one shell-quoted string)")
    p.add_argument("--prefill-args", default="", help="extra prefill flags")
    p.add_argument("--decode-args", default="", help="extra decode flags")
    p.add_argument("--ready-timeout-s", type=float, default=600.0,
                   help="per setup: start-up deadline (the first start converts the model)")
    p.add_argument("--out-dir", default="bench-results/experiment")
    p.add_argument("--dry-run", action="store_true", help="print the plan and commands; start nothing")
    p.add_argument("--analyze-only", action="store_true",
                   help="compare the results already saved in --out-dir; start nothing")
    p.add_argument("--no-progress", action="store_true")
    return p


def _parse_cores(text: str | None) -> tuple[int, int]:
    if text is None:
        allowed = sorted(os.sched_getaffinity(0))
        if len(allowed) < 2:
            raise BenchConfigError(f"the experiment needs two CPU cores; this process may use {allowed}")
        return allowed[0], allowed[1]
    try:
        cores = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise BenchConfigError(f"--cores {text!r}: expected two integers") from None
    if len(cores) != 2 or cores[0] == cores[1] or min(cores) < 0:
        raise BenchConfigError(f"--cores {text!r}: expected two distinct CPU ids")
    return cores  # type: ignore[return-value]


def settings_from_args(args: argparse.Namespace) -> tuple[ServeSettings, SyntheticWorkload]:
    try:
        rates = tuple(float(x) for x in args.rates.split(",") if x.strip())
    except ValueError:
        raise BenchConfigError(f"--rates {args.rates!r}: expected numbers") from None
    if any(not math.isfinite(r) for r in rates):
        raise BenchConfigError("--rates: the experiment sweeps finite rates")
    plan = LoadPlan(arrival=args.arrival, loads=rates, num_requests=args.num_requests,
                    duration_s=args.duration_s, warmup_requests=args.warmup_requests,
                    seed=args.seed)
    classes = parse_mix(args.mix or ["long:1:1000-2000:128", "chat:3:16-128:32-128"])
    workload = SyntheticWorkload(classes, args.seed)  # both setups: the same prompts per rate
    endpoint = Endpoint("http://127.0.0.1:0/v1", None, None, args.endpoint, 0.0,
                        args.extra_body, args.request_timeout_s)
    if not (args.slo_ttft_ms > 0 and args.slo_tpot_ms > 0):
        raise BenchConfigError("SLOs must be > 0 ms")
    description = "; ".join(f"{c.name} x{c.weight:g}: input {c.input_len}, output {c.output_len}"
                            for c in classes)
    return ServeSettings(endpoint, plan, Slo(args.slo_ttft_ms, args.slo_tpot_ms), description), workload


def _setups(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names or any(n not in SETUPS for n in names):
        raise BenchConfigError(f"--setups {text!r}: choose from {SETUPS}")
    return names


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    out_dir = Path(args.out_dir)
    try:
        setups = _setups(args.setups)
        settings, workload = settings_from_args(args)
        if args.analyze_only:
            return _analyze(out_dir, settings.slo)
        opts = ServiceOptions(
            model=args.model, device=args.device, cores=_parse_cores(args.cores),
            kv_backends=args.kv_backends, log_level=args.log_level,
            router_args=tuple(shlex.split(args.router_args)),
            prefill_args=tuple(shlex.split(args.prefill_args)),
            decode_args=tuple(shlex.split(args.decode_args)))
    except BenchConfigError as e:
        print(f"pdserve bench experiment: {e}", file=sys.stderr)
        return 2
    plans = [plan_setup(name, opts, Ports.pick()) for name in setups]
    print(f"workload: {settings.workload}; rates {list(settings.plan.loads)} req/s "
          f"({settings.plan.arrival}), {settings.plan.num_requests} requests or "
          f"{settings.plan.duration_s:g} s per rate")
    for plan in plans:
        print(f"[{plan.name}] endpoint {plan.base_url}")
        for spec in plan.services:
            print(f"  {spec.command_line()}")
    if args.dry_run:
        return 0
    series: dict[str, list[RunSummary]] = {}
    for plan in plans:
        try:
            series[plan.name] = run_setup(plan, settings, workload, out_dir,
                                          args.ready_timeout_s, not args.no_progress)
        except (LaunchError, BenchConfigError) as e:
            print(f"[{plan.name}] failed: {e}", file=sys.stderr)
            return 1
    for name, summaries in series.items():
        print(f"\n[{name}]\n{format_table(summaries)}")
    if set(series) == set(SETUPS):
        print("\n" + write_analysis(out_dir, series, settings.slo))
        print(f"wrote {out_dir / 'experiment.json'}, {out_dir / 'experiment.png'}")
    return 0


def _analyze(out_dir: Path, slo: Slo) -> int:
    """Compare saved results, goodput scored under `slo` (--slo-ttft-ms / --slo-tpot-ms)
    from the saved per-request records, so one measurement can be judged under several SLOs."""
    series = {}
    for name in SETUPS:
        path = out_dir / name / "serve_results.json"
        if not path.exists():
            print(f"pdserve bench experiment: {path} is missing; run that setup first", file=sys.stderr)
            return 2
        series[name] = load_summaries(path, slo)
        if not series[name]:
            print(f"pdserve bench experiment: {path} holds no runs", file=sys.stderr)
            return 2
    print(write_analysis(out_dir, series, slo))
    return 0

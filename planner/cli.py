"""`pdserve plan` and `pdserve profile`: their flags and what they print.

`plan` imports no torch unless `--model` asks it to check the profile's compatibility hash;
`profile` loads the model (`planner/profiler.py`)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Sequence

from pdserve.common.errors import PdserveError
from pdserve.planner.profile import Profile, load_profile
from pdserve.planner.search import Evaluation, SearchSpace, plan, steady_count
from pdserve.planner.types import Slo
from pdserve.planner.workload import mean_lengths, random_workload, read_trace


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers separated by commas") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 0")
    return values


def add_plan_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="simulate deployments of a profiled model under a workload and SLOs; "
                                    "rank them and print the best one's flags")
    p.add_argument("--profile", required=True, help="a profile JSON from `pdserve profile`")
    p.add_argument("--model", help="refuse the profile unless it was measured for this model "
                                   "(by its KV compatibility hash; loads the model's config and weights' fingerprint)")
    p.add_argument("--compat-hash", help="the same check against a known hash (hex)")
    w = p.add_argument_group("workload: a trace, or bench serve's random workload")
    w.add_argument("--trace", help="JSON lines of {arrival_s, input_len, output_len[, cached_len]} "
                                   "(`pdserve bench serve --trace-out` records one)")
    w.add_argument("--request-rate", type=float, help="req/s, Poisson arrivals")
    w.add_argument("--input-len", type=int, default=256, help="prompt tokens (default 256)")
    w.add_argument("--output-len", type=int, default=128, help="generated tokens (default 128)")
    w.add_argument("--num-requests", type=int, default=400,
                   help="simulated requests, at least (more where the load's steady state needs them; default 400)")
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("SLOs")
    s.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="(default 2000)")
    s.add_argument("--slo-tpot-ms", type=float, default=100.0, help="(default 100)")
    s.add_argument("--slo-percentile", type=float, default=90.0, help="(default 90)")
    s.add_argument("--slo-attainment", type=float, default=0.9,
                   help="fraction of requests within both SLOs (default 0.9)")
    b = p.add_argument_group("budget")
    b.add_argument("--gpus", type=int, help="GPUs in all (each worker takes the profile's devices_per_worker)")
    b.add_argument("--hosts", type=int, default=1, help="CPU hosts (default 1)")
    b.add_argument("--cores", type=int, help="CPU cores per host (default: the profile's machine); on one host "
                                             "every worker shares them, on several each worker owns "
                                             "the profile's threads")
    c = p.add_argument_group("candidates")
    c.add_argument("--chunk-budgets", type=_ints, default=(256, 2048), help="max_num_tokens values (default 256,2048)")
    c.add_argument("--batch-limits", type=_ints, default=(64,), help="max_batch_size values (default 64)")
    c.add_argument("--local-prefill-thresholds", type=_ints, default=(32,), help="(default 32)")
    c.add_argument("--max-unit", type=int, default=8, help="most workers in one xPyD unit (default 8)")
    p.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    p.add_argument("--json", action="store_true", help="one JSON object per candidate, ranked, on stdout")
    p.add_argument("--served-step-ms", type=float, help="what a served worker adds to each engine step (default: "
                   "the profile's; `bench plan-check` reports the value its run implies)")
    return p


def run_plan(args: argparse.Namespace) -> int:
    try:
        profile = load_profile(args.profile)
        if args.served_step_ms is not None:
            profile = dataclasses.replace(profile, served_step_s=args.served_step_ms / 1000)
        if args.model:
            from pdserve.planner.compat import model_compat_hash

            profile.check_compatible(model_compat_hash(args.model))
        if args.compat_hash:
            profile.check_compatible(args.compat_hash.lower().removeprefix("0x"))
        trace, rate = _workload(args, profile)
        slo = _slo(args)
        devices, space = _budget(args, profile)
        ranked = plan(profile, trace, slo, devices, rate, space)
    except (PdserveError, ValueError) as exc:
        print(f"pdserve plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        for e in ranked:
            print(json.dumps(e.as_json()))
    else:
        print(render(profile, ranked, slo, rate, args.top))
    return 0


def _workload(args: argparse.Namespace, profile: Profile):
    if args.trace:
        if args.request_rate is not None:
            raise ValueError("give --trace or --request-rate, not both")
        trace = read_trace(args.trace)
        return trace, mean_lengths(trace)[0]
    if args.request_rate is None:
        raise ValueError("give a workload: --trace FILE, or --request-rate R (with --input-len, --output-len)")
    if args.input_len < 1 or args.output_len < 1 or args.num_requests < 1:
        raise ValueError("--input-len, --output-len and --num-requests must be >= 1")
    count = steady_count(profile, args.request_rate, args.input_len, args.output_len, args.num_requests)
    return (random_workload(args.request_rate, args.input_len, args.output_len, count, args.seed),
            args.request_rate)


def _slo(args: argparse.Namespace) -> Slo:
    if not (args.slo_ttft_ms > 0 and args.slo_tpot_ms > 0):
        raise ValueError("SLOs must be > 0 ms")
    if not (0 < args.slo_percentile <= 100 and 0 < args.slo_attainment <= 1):
        raise ValueError("--slo-percentile must be in (0, 100] and --slo-attainment in (0, 1]")
    return Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_percentile, args.slo_attainment)


def _budget(args: argparse.Namespace, profile: Profile) -> tuple[int, SearchSpace]:
    space = dict(chunk_budgets=args.chunk_budgets, batch_limits=args.batch_limits,
                 local_prefill_thresholds=args.local_prefill_thresholds, max_unit=args.max_unit)
    if args.gpus is not None:
        if profile.device == "cpu":
            raise ValueError("--gpus needs a GPU profile; this one was measured on CPU (use --cores)")
        if args.gpus < 1:
            raise ValueError("--gpus must be >= 1")
        return args.gpus, SearchSpace(**space)
    if profile.device != "cpu":
        raise ValueError("a GPU profile plans for --gpus N")
    cores = args.cores or profile.machine.num_cores or profile.threads
    if cores < 1 or args.hosts < 1:
        raise ValueError("--cores and --hosts must be >= 1")
    if args.hosts == 1:
        return cores, SearchSpace(**space, shared_host_cores=cores)
    return args.hosts * cores // profile.threads, SearchSpace(**space)


def render(profile: Profile, ranked: Sequence[Evaluation], slo: Slo, rate: float, top: int) -> str:
    q = slo.percentile
    lines = [f"profile {profile.model} on {profile.machine.accelerator or profile.machine.cpu_model or profile.device} "
             f"({profile.source.splitlines()[0][:80]})",
             f"load {rate:g} req/s; SLO TTFT p{q:g} <= {slo.ttft_ms:g} ms, TPOT p{q:g} <= {slo.tpot_ms:g} ms, "
             f"attainment >= {slo.attainment:.0%}",
             f"{'#':>3} {'config':>15} {'chunk':>6} {'batch':>5} {'thr':>4} {'TTFT p50':>9} {'p90':>8} "
             f"{'TPOT p50':>9} {'p90':>7} {'attain':>7} {'goodput':>8} {'/device':>8} {'bound':>8} meets"]
    for i, e in enumerate(ranked[:top], 1):
        d = e.candidate.deployment
        c = e.candidate
        name = f"{c.replicas} x {c.unit.config}" if c.replicas > 1 else e.config
        lines.append(f"{i:>3} {name:>15} {d.decode.max_num_tokens:>6} {d.decode.max_batch_size:>5} "
                     f"{d.local_prefill_threshold if d.num_prefill else '-':>4} {_ms(e.ms('ttft', 50)):>9} "
                     f"{_ms(e.ms('ttft', 90)):>8} {_ms(e.ms('tpot', 50)):>9} {_ms(e.ms('tpot', 90)):>7} "
                     f"{e.attainment:>7.1%} {e.goodput_rps:>8.3f} {e.goodput_per_device:>8.3f} {e.bound:>8} "
                     f"{'yes' if e.meets else 'no'}")
    if not ranked:
        return "\n".join(lines + ["no candidate fits the budget"])
    best = ranked[0]
    if not best.meets:
        lines.append(f"no candidate meets the SLO; the nearest is {best.config} (attainment {best.attainment:.1%}, "
                     f"TTFT p{q:g} {_ms(best.ms('ttft', q))} ms, TPOT p{q:g} {_ms(best.ms('tpot', q))} ms, "
                     f"bound by {best.bound})")
    lines += ["", f"{'recommended' if best.meets else 'nearest'}: {best.config}", recommend(best)]
    return "\n".join(lines)


def _ms(value: float) -> str:
    return f"{value:.0f}" if math.isfinite(value) else "inf"


def recommend(e: Evaluation) -> str:
    """The `pdserve up` flags and the chart values that run `e`'s deployment."""
    d = e.candidate.deployment
    knobs = f"--max-num-tokens {d.decode.max_num_tokens} --max-batch-size {d.decode.max_batch_size}"
    if d.num_prefill == 0:
        up = f"  pdserve up --local-prefill --num-decode {d.num_decode} {knobs}"
    else:
        up = (f"  pdserve up --num-prefill {d.num_prefill} --num-decode {d.num_decode} {knobs} "
              f"--local-prefill-threshold {d.local_prefill_threshold}")
    helm = [f"  prefill: {{replicas: {d.num_prefill}}}", f"  decode: {{replicas: {d.num_decode}}}",
            f"  engine: {{maxNumTokens: {d.decode.max_num_tokens}, maxBatchSize: {d.decode.max_batch_size}}}"]
    if d.num_prefill:
        helm.append(f"  router: {{localPrefillThreshold: {d.local_prefill_threshold}}}")
    return "\n".join(["on one machine:", up, "Helm values (deploy/helm/pdserve):", *helm])


def add_profile_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("profile", help="measure a model on this machine with the engine and write a profile "
                                       "JSON for `pdserve plan`")
    p.add_argument("--model", default="default", help="'default', a transformers directory or a .gguf file")
    p.add_argument("--out", default="profile.json", help="where to write the profile (default profile.json)")
    p.add_argument("--quick", action="store_true", help="a small grid: well under a minute (tests, a first look)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="as the workers' --device (default cpu)")
    p.add_argument("--num-threads", type=int, default=0, help="torch intra-op threads (0: torch's choice)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--quantization", default="auto", help="as the workers' --quantization (default auto)")
    p.add_argument("--speculative-config", default="", help="as the decode's: measures drafts kept per step")
    p.add_argument("--transfer-backends", default=None,
                   help="KV backends whose link to measure (bench transfer), comma separated; a loopback "
                        "TCP socket is always measured (default ucx; --quick: the socket only)")
    return p


def run_profile(args: argparse.Namespace, transfer_probe_for) -> int:
    """`transfer_probe_for(backends)`: a callable measuring those links (the CLI's, from bench)."""
    from pdserve.planner.profile import save_profile
    from pdserve.planner.profiler import QUICK, Grid, measure

    backends = args.transfer_backends if args.transfer_backends is not None else ("" if args.quick else "ucx")
    try:
        profile = measure(args.model, grid=QUICK if args.quick else Grid(), device=args.device,
                          num_threads=args.num_threads,
                          dtype=args.dtype, block_size=args.block_size, quantization=args.quantization,
                          speculative_config=args.speculative_config,
                          transfer_probe=transfer_probe_for([b for b in backends.split(",") if b.strip()]),
                          log=lambda line: print(line, flush=True))
    except PdserveError as exc:
        print(f"pdserve profile: {exc}", file=sys.stderr)
        return 2
    path = save_profile(profile, args.out)
    s = profile.step
    print(f"step cost: {s.base_s * 1000:.2f} ms + {s.prefill_token_s * 1e6:.1f} us per prompt token + "
          f"{s.decode_seq_s * 1e6:.1f} us per decoding sequence + {s.decode_context_s * 1e9:.1f} ns per context token")
    for t in profile.transfers:
        print(f"link {t.backend}: {t.bytes_per_s / 1e9:.2f} GB/s, tail {t.tail_s * 1000:.2f} ms")
    print(f"KV: {profile.kv_bytes_per_token} bytes per token, {profile.kv_tokens} tokens per worker; "
          f"compatibility hash {profile.compat_hash}")
    print(f"wrote {path}")
    return 0

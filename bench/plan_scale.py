"""`pdserve bench plan-scale`: `pdserve plan` at fleet scale, on paper.

For a GPU profile (one built from published figures until a GPU measures one), three
workloads and two SLOs each, it finds the goodput of each replica unit (colocated, xPyD with
up to `--max-unit` workers): the highest request rate one unit serves within the SLO
(`search.max_goodput`), over the GPUs it takes. A fleet of N GPUs holds N // size replicas
of a unit and the router spreads the load evenly over them, so a fleet's goodput per GPU is
the unit's times the fraction of GPUs its replicas fill. Units: colocated and the xPyD
ratios of `RATIOS`. For N from 8 to 512 it reports the best unit against colocated; then, for the chat workload, how the best xPyD's advantage moves
with the transfer link's bandwidth per GPU (where it stops paying). Writes a Markdown table and a
plot.

    pdserve bench plan-scale --profile docs/profiles/h100-llama3-8b-published.json \\
        --out-dir docs --name plan-scale-h100-8b
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pdserve.bench.cli import HelpFormatter
from pdserve.planner.profile import TransferCost, load_profile
from pdserve.planner.search import SearchSpace, _knobs, max_goodput
from pdserve.planner.simulator import Deployment
from pdserve.planner.types import Slo
from pdserve.planner.workload import mixed_workload

FLEETS = (8, 16, 32, 64, 128, 256, 512)
LINKS_GBPS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 50.0)  # GB/s per prefill worker's link


@dataclass(frozen=True, slots=True)
class Study:
    """A workload (mean input, mean output; lengths spread 0.5-1.5x around them) and its SLOs."""

    name: str
    input_len: int
    output_len: int
    slos: tuple[Slo, ...]


STUDIES = (
    Study("chat (ShareGPT-like)", 700, 200, (Slo(500, 50), Slo(200, 25))),
    Study("summarization", 3000, 150, (Slo(2000, 50), Slo(800, 30))),
    Study("coding", 1500, 60, (Slo(300, 30), Slo(150, 20))),
)


def unit_goodput(profile, unit: Deployment, study: Study, slo: Slo, num_requests: int) -> float:
    """Requests per second one unit serves within `slo`."""
    def trace_of(rate: float, count: int):
        return mixed_workload(rate, [(1.0, study.input_len, study.output_len)], count)

    return max_goodput(profile, unit, slo, study.input_len, study.output_len, iterations=7, trace_of=trace_of)


RATIOS = ((0, 1), (1, 1), (1, 2), (1, 3), (1, 5), (2, 1), (3, 1), (2, 3), (3, 2))  # the units tried


def unit_deployments(profile, space: SearchSpace) -> list[Deployment]:
    """Colocated at each chunk budget (it trades TTFT for TPOT there); xPyD at the largest
    (a decode that prefills little gains nothing from a small one), in the ratios of `RATIOS`."""
    out = []
    widest = dataclasses.replace(space, chunk_budgets=(max(space.chunk_budgets),))
    for num_prefill, num_decode in RATIOS:
        out += list(_knobs(num_prefill, num_decode, space if num_prefill == 0 else widest))
    return out


def study_units(profile, study: Study, slo: Slo, space: SearchSpace, num_requests: int) -> dict:
    """(prefill, decode) -> (best goodput per GPU of the unit, the unit, its goodput)."""
    best: dict[tuple[int, int], tuple[float, Deployment, float]] = {}
    for unit in unit_deployments(profile, space):
        rate = unit_goodput(profile, unit, study, slo, num_requests)
        gpus = (unit.num_prefill + unit.num_decode) * profile.devices_per_worker
        key = (unit.num_prefill, unit.num_decode)
        if key not in best or rate / gpus > best[key][0]:
            best[key] = (rate / gpus, unit, rate)
    return best


def fleet_row(profile, best: dict, gpus: int) -> tuple[str, float, float]:
    """The best fleet of `gpus` GPUs: (config, goodput per GPU, colocated's goodput per GPU)."""
    def per_gpu(key) -> float:
        size = (key[0] + key[1]) * profile.devices_per_worker
        return best[key][2] * (gpus // size) / gpus

    top = max(best, key=per_gpu)
    size = (top[0] + top[1]) * profile.devices_per_worker
    replicas = gpus // size
    name = "colocated" if top[0] == 0 else f"{top[0] * replicas}p{top[1] * replicas}d"
    return name, per_gpu(top), per_gpu((0, 1)) if (0, 1) in best else 0.0


def link_sweep(profile, study: Study, slo: Slo, best: dict, num_requests: int) -> list[tuple[float, float, float]]:
    """(GB/s per GPU, best xPyD's goodput per GPU, colocated's) as the link narrows."""
    disagg = sorted((k for k in best if k[0]), key=lambda k: -best[k][0])[:2]
    colocated = best[(0, 1)][0] if (0, 1) in best else 0.0
    out = []
    for gbps in LINKS_GBPS:
        link = TransferCost(f"{gbps:g}GB/s", gbps * 1e9 * profile.devices_per_worker, 0.001)
        slow = dataclasses.replace(profile, transfers=(link,))
        rates = [unit_goodput(slow, best[k][1], study, slo, num_requests) / ((k[0] + k[1]) * profile.devices_per_worker)
                 for k in disagg]
        out.append((gbps, max(rates, default=0.0), colocated))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench plan-scale", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--profile", required=True)
    p.add_argument("--num-requests", type=int, default=200,
                   help="simulated requests per rate tried, at least (more where the steady state needs them)")
    p.add_argument("--out-dir", default="docs")
    p.add_argument("--name", default="plan-scale")
    return p


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    profile = load_profile(args.profile)
    # a GPU decode batches as vLLM's default max_num_seqs does (256)
    space = SearchSpace(chunk_budgets=(512, 2048), batch_limits=(256,), max_unit=max(sum(r) for r in RATIOS))
    started = time.monotonic()
    lines = ["| workload | SLO p90 TTFT / TPOT | GPUs | best | goodput/GPU (req/s) | colocated | best / colocated |",
             "|---|---|---:|---|---:|---:|---:|"]
    curves, sweep = {}, None
    for study in STUDIES:
        for slo in study.slos:
            best = study_units(profile, study, slo, space, args.num_requests)
            label = f"{study.name}, {slo.ttft_ms:g}/{slo.tpot_ms:g} ms"
            curves[label] = [fleet_row(profile, best, n) for n in FLEETS]
            for n, (name, good, colo) in zip(FLEETS, curves[label]):
                ratio = f"{good / colo:.2f}x" if colo else "colocated meets no rate"
                lines.append(f"| {study.name} | {slo.ttft_ms:g} / {slo.tpot_ms:g} ms | {n} | {name} | {good:.2f} | "
                             f"{colo:.2f} | {ratio} |")
            print(f"{label}: done after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
            if sweep is None:
                sweep = (label, link_sweep(profile, study, slo, best, args.num_requests))
    lines += ["", f"Link bandwidth per GPU, {sweep[0]} (the better of the two best xPyD units at 300 GB/s):", "",
              "| GB/s per GPU | best xPyD goodput/GPU | colocated | xPyD / colocated |", "|---:|---:|---:|---:|"]
    lines += [f"| {g:g} | {d:.2f} | {c:.2f} | {d / c:.2f}x |" if c else f"| {g:g} | {d:.2f} | 0 | - |"
              for g, d, c in sweep[1]]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    _plot(curves, sweep, out / f"{args.name}.png", profile.model)
    print("\n".join(lines))
    print(f"wrote {out / (args.name + '.md')} and {out / (args.name + '.png')} in {time.monotonic() - started:.0f} s")
    return 0


def _plot(curves: dict, sweep, path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for label, rows in curves.items():
        ratio = [good / colo if colo else float("nan") for _, good, colo in rows]
        left.plot(FLEETS, ratio, marker="o", label=label)
    left.axhline(1.0, color="grey", lw=0.8)
    left.set_xscale("log", base=2)
    left.set_xlabel("GPUs")
    left.set_ylabel("best config's goodput per GPU / colocated's")
    left.set_title(f"{model}: best xPyD against colocated")
    left.legend(fontsize=7)
    gbps = [g for g, _, _ in sweep[1]]
    right.plot(gbps, [d / c if c else float("nan") for _, d, c in sweep[1]], marker="o")
    right.axhline(1.0, color="grey", lw=0.8)
    right.set_xscale("log")
    right.set_xlabel("transfer link, GB/s per GPU")
    right.set_ylabel("best xPyD goodput per GPU / colocated's")
    right.set_title(sweep[0])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

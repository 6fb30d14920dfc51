"""Disaggregated against colocated: pair the two setups' runs by rate, judge the targets.

Ratios are oriented so that > 1 favours disaggregation. The issue's targets: at the highest
rate where colocated still meets the TTFT SLO on p99, disaggregated TPOT p99 at least 2x
lower; and goodput (requests/s within both SLOs) at least 1.5x, compared here as the best
goodput each setup reached over the sweep.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pdserve.bench.report import RunSummary, Slo, plot_against_load, to_jsonable

SETUPS = ("disaggregated", "colocated")
TPOT_TARGET_RATIO = 2.0
GOODPUT_TARGET_RATIO = 1.5


@dataclass(frozen=True, slots=True)
class RateComparison:
    """One request rate, both setups. Ratios are oriented so > 1 favours disaggregation."""

    rate: float
    disaggregated: RunSummary
    colocated: RunSummary
    ttft_p99_ratio: float | None  # colocated / disaggregated
    tpot_p99_ratio: float | None  # colocated / disaggregated
    goodput_ratio: float | None  # disaggregated / colocated


@dataclass(frozen=True, slots=True)
class Verdict:
    """The issue's two targets, evaluated on a sweep."""

    reference_rate: float | None  # highest rate where colocated TTFT p99 <= the TTFT SLO
    tpot_p99_ratio_at_reference: float | None
    best_goodput_disaggregated: float
    best_goodput_colocated: float
    best_goodput_ratio: float | None
    meets_tpot_target: bool
    meets_goodput_target: bool


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None:
        return None
    if den == 0:
        return math.inf if num > 0 else None
    return num / den


def compare(disaggregated: Sequence[RunSummary],
            colocated: Sequence[RunSummary]) -> list[RateComparison]:
    """Pair the runs of the two setups by request rate (rates only one setup ran are dropped)."""
    by_rate = {s.load: s for s in colocated}
    rows = []
    for d in sorted(disaggregated, key=lambda s: s.load):
        c = by_rate.get(d.load)
        if c is None:
            continue
        rows.append(RateComparison(
            d.load, d, c, ttft_p99_ratio=_ratio(c.ttft.p99_ms, d.ttft.p99_ms),
            tpot_p99_ratio=_ratio(c.tpot.p99_ms, d.tpot.p99_ms),
            goodput_ratio=_ratio(d.goodput, c.goodput)))
    return rows


def judge(rows: Sequence[RateComparison], slo: Slo) -> Verdict:
    meeting = [r for r in rows if r.colocated.ttft.p99_ms is not None
               and r.colocated.ttft.p99_ms <= slo.ttft_ms]
    reference = max(meeting, key=lambda r: r.rate) if meeting else None
    best_d = max((r.disaggregated.goodput for r in rows), default=0.0)
    best_c = max((r.colocated.goodput for r in rows), default=0.0)
    tpot_ratio = reference.tpot_p99_ratio if reference else None
    goodput_ratio = _ratio(best_d, best_c)
    return Verdict(
        reference_rate=reference.rate if reference else None,
        tpot_p99_ratio_at_reference=tpot_ratio,
        best_goodput_disaggregated=best_d, best_goodput_colocated=best_c,
        best_goodput_ratio=goodput_ratio,
        meets_tpot_target=tpot_ratio is not None and tpot_ratio >= TPOT_TARGET_RATIO,
        meets_goodput_target=goodput_ratio is not None and goodput_ratio >= GOODPUT_TARGET_RATIO)


def _f(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else ("inf" if math.isinf(v) else format(v, fmt))


def format_comparison(rows: Sequence[RateComparison], verdict: Verdict, slo: Slo) -> str:
    head = (f"{'rate':>6} | {'TTFT p99 ms: dis':>17} {'col':>8} {'x':>6} | "
            f"{'TPOT p99 ms: dis':>17} {'col':>7} {'x':>6} | "
            f"{'goodput: dis':>13} {'col':>6} {'x':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        d, c = r.disaggregated, r.colocated
        lines.append(
            f"{r.rate:>6g} | {_f(d.ttft.p99_ms):>17} {_f(c.ttft.p99_ms):>8} "
            f"{_f(r.ttft_p99_ratio, '.2f'):>6} | {_f(d.tpot.p99_ms):>17} {_f(c.tpot.p99_ms):>7} "
            f"{_f(r.tpot_p99_ratio, '.2f'):>6} | {_f(d.goodput, '.3f'):>13} "
            f"{_f(c.goodput, '.3f'):>6} {_f(r.goodput_ratio, '.2f'):>6}")
    lines.append(f"ratios: TTFT, TPOT colocated/disaggregated; goodput disaggregated/colocated "
                 f"(SLO TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms)")
    if verdict.reference_rate is None:
        lines.append(f"colocated never met TTFT p99 <= {slo.ttft_ms:g} ms: no reference rate "
                     f"for the TPOT target")
    else:
        lines.append(f"at {verdict.reference_rate:g} req/s (highest rate with colocated TTFT p99 "
                     f"within SLO): TPOT p99 ratio {_f(verdict.tpot_p99_ratio_at_reference, '.2f')}"
                     f" (target >= {TPOT_TARGET_RATIO:g}: "
                     f"{'met' if verdict.meets_tpot_target else 'not met'})")
    lines.append(f"best goodput: disaggregated {verdict.best_goodput_disaggregated:.3f}, colocated "
                 f"{verdict.best_goodput_colocated:.3f} req/s, ratio "
                 f"{_f(verdict.best_goodput_ratio, '.2f')} (target >= {GOODPUT_TARGET_RATIO:g}: "
                 f"{'met' if verdict.meets_goodput_target else 'not met'})")
    return "\n".join(lines)


def write_analysis(out_dir: Path, series: dict[str, list[RunSummary]], slo: Slo) -> str:
    """Compare what both setups saved, write experiment.json + experiment.png, return the text."""
    rows = compare(series["disaggregated"], series["colocated"])
    verdict = judge(rows, slo)
    doc = {"slo": to_jsonable(slo), "comparisons": to_jsonable(rows), "verdict": to_jsonable(verdict)}
    (out_dir / "experiment.json").write_text(json.dumps(doc, indent=1, allow_nan=False))
    plot_against_load(series, out_dir / "experiment.png",
                      "disaggregated (prefill core A, decode core B) vs colocated (both cores)")
    return format_comparison(rows, verdict, slo)

"""Benchmark results: per-request records, aggregate statistics, JSON, tables and plots.

Definitions (all latencies measured at the client, from the moment the request is sent):
    TTFT   time to the first streamed chunk that carries output text
    ITL    time between consecutive text chunks (one token per chunk on pdserve)
    TPOT   (e2e - TTFT) / (output_tokens - 1); undefined for a single output token
    e2e    time to the end of the stream
    goodput  requests per second that succeeded with TTFT <= SLO and TPOT <= SLO
             (a request with one output token has no TPOT and is judged on TTFT only)
Percentiles interpolate linearly between order statistics (numpy's default).
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float
    tpot_ms: float

    def is_met(self, result: "RequestResult") -> bool:
        if not result.success or result.ttft_s is None:
            return False
        if result.ttft_s * 1000.0 > self.ttft_ms:
            return False
        tpot_s = result.tpot_s
        return tpot_s is None or tpot_s * 1000.0 <= self.tpot_ms


def tpot(e2e_s: float, ttft_s: float, output_tokens: int) -> float | None:
    """Mean time per output token after the first; None below two tokens."""
    if output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What one request measured. Failed requests keep whatever they saw before failing."""

    index: int
    class_name: str
    success: bool
    error: str  # "" when success
    start_s: float  # send time, relative to the start of the run
    ttft_s: float | None
    e2e_s: float | None
    itl_s: tuple[float, ...]
    output_tokens: int  # usage.completion_tokens, else the number of text chunks
    prompt_tokens: int | None  # usage.prompt_tokens (the server's count), None if not reported
    usage_reported: bool
    num_chunks: int  # text-bearing chunks received
    finish_reason: str
    target_input_tokens: int | None
    max_tokens: int
    text_sha256: str = ""  # of the whole output text: greedy runs of two servers compare by it
    # usage.completion_tokens_details: drafts the server's speculation kept and rejected
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None
    # usage.prompt_tokens_details: prompt tokens the server found cached, and by tier where it says
    cached_tokens: int | None = None
    cached_tokens_by_tier: tuple[tuple[str, int], ...] = ()

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.ttft_s is None or self.e2e_s is None:
            return None
        return tpot(self.e2e_s, self.ttft_s, self.output_tokens)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; `values` must be non-empty."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} outside [0, 100]")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Milliseconds; every field but `count` is None when there are no samples."""

    count: int
    mean_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_ms: float | None

    @classmethod
    def of(cls, values_s: Iterable[float]) -> "LatencyStats":
        ms = [v * 1000.0 for v in values_s]
        if not ms:
            return cls(0, None, None, None, None, None)
        return cls(len(ms), sum(ms) / len(ms), percentile(ms, 50), percentile(ms, 90),
                   percentile(ms, 99), max(ms))


@dataclass(frozen=True, slots=True)
class RunSummary:
    """Aggregates of one run (one request rate or one concurrency of a sweep)."""

    label: str
    arrival: str  # "poisson" | "fixed" | "closed"
    load: float  # offered request rate (req/s; inf = all at once) or concurrency
    num_requests: int
    num_succeeded: int
    num_failed: int
    duration_s: float
    request_throughput: float  # succeeded requests / s
    output_throughput: float  # output tokens of succeeded requests / s
    prompt_throughput: float  # prompt tokens (server-counted) of succeeded requests / s
    goodput: float  # requests / s meeting the SLO
    num_good: int
    total_prompt_tokens: int
    total_output_tokens: int
    slo: Slo
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    errors: tuple[tuple[str, int], ...]  # most common error messages with counts


def summarize(label: str, arrival: str, load: float, results: Sequence[RequestResult],
              duration_s: float, slo: Slo) -> RunSummary:
    ok = [r for r in results if r.success]
    good = sum(1 for r in ok if slo.is_met(r))
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    errors = Counter(r.error for r in results if not r.success).most_common(5)
    return RunSummary(
        label=label, arrival=arrival, load=load, num_requests=len(results),
        num_succeeded=len(ok), num_failed=len(results) - len(ok), duration_s=duration_s,
        request_throughput=len(ok) * per_s, output_throughput=out_tokens * per_s,
        prompt_throughput=prompt_tokens * per_s, goodput=good * per_s, num_good=good,
        total_prompt_tokens=prompt_tokens, total_output_tokens=out_tokens, slo=slo,
        ttft=LatencyStats.of(r.ttft_s for r in ok if r.ttft_s is not None),
        tpot=LatencyStats.of(t for r in ok if (t := r.tpot_s) is not None),
        itl=LatencyStats.of(x for r in ok for x in r.itl_s),
        e2e=LatencyStats.of(r.e2e_s for r in ok if r.e2e_s is not None),
        errors=tuple(errors),
    )


@dataclass(frozen=True, slots=True)
class BenchRun:
    summary: RunSummary
    results: tuple[RequestResult, ...]


# ---------------------------------------------------------------- JSON


def to_jsonable(value):
    """dataclasses -> dicts, tuples -> lists; inf/nan (not valid JSON) -> strings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def write_json(path: Path, config: object, runs: Sequence[BenchRun]) -> Path:
    """One file: the config, then per run its summary and every request's record."""
    doc = {"config": to_jsonable(config),
           "runs": [{"summary": to_jsonable(r.summary), "requests": to_jsonable(r.results)}
                    for r in runs]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False))
    tmp.replace(path)
    return path


def summary_from_json(doc: Mapping) -> RunSummary:
    """Rebuild a RunSummary from its JSON form (for analysing saved results); float()
    also reads back the "inf" that `to_jsonable` writes for an infinite rate."""
    try:
        stats = {k: LatencyStats(**doc[k]) for k in ("ttft", "tpot", "itl", "e2e")}
        plain = {f.name: doc[f.name] for f in dataclasses.fields(RunSummary)
                 if f.name not in stats and f.name not in ("slo", "errors", "load")}
        return RunSummary(**plain, **stats, load=float(doc["load"]), slo=Slo(**doc["slo"]),
                          errors=tuple((str(m), int(c)) for m, c in doc["errors"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a run summary: {e}") from None


def load_summaries(path: Path, slo: Slo | None = None) -> list[RunSummary]:
    """The run summaries of a serve_results.json written by `write_json`. With `slo`, each
    run's goodput is scored again under it from the saved per-request records."""
    doc = json.loads(Path(path).read_text())
    summaries = []
    for run in doc["runs"]:
        summary = summary_from_json(run["summary"])
        if slo is not None and slo != summary.slo:
            summary = rescore(summary, [request_from_json(r) for r in run["requests"]], slo)
        summaries.append(summary)
    return summaries


def request_from_json(doc: Mapping) -> RequestResult:
    try:
        values = {f.name: doc[f.name] for f in dataclasses.fields(RequestResult)
                  if f.name in doc or f.default is dataclasses.MISSING}
    except KeyError as e:
        raise ValueError(f"not a request record: missing {e}") from None
    values["itl_s"] = tuple(values["itl_s"])
    if "cached_tokens_by_tier" in values:
        values["cached_tokens_by_tier"] = tuple((str(t), int(n)) for t, n in values["cached_tokens_by_tier"])
    return RequestResult(**values)


def format_speculation(label: str, runs: Sequence[BenchRun]) -> str | None:
    """Per load: drafts kept of those checked (usage.completion_tokens_details) and output
    tokens per stream chunk (a chunk is one engine step's delta); None when the server
    reported no drafts."""
    rows = []
    for run in runs:
        ok = [r for r in run.results if r.success]
        kept = sum(r.accepted_prediction_tokens or 0 for r in ok)
        checked = kept + sum(r.rejected_prediction_tokens or 0 for r in ok)
        chunks = sum(r.num_chunks for r in ok)
        if checked:
            per_chunk = sum(r.output_tokens for r in ok) / chunks if chunks else 0.0
            rows.append(f"{run.summary.label:>14} drafts kept {kept}/{checked} ({100 * kept / checked:.0f}%), "
                        f"{per_chunk:.2f} output tokens per step")
    return f"speculation at {label}\n" + "\n".join(rows) if rows else None


def format_text_agreement(a: Sequence[BenchRun], b: Sequence[BenchRun]) -> str:
    """Per load: how many requests both servers answered with the same text."""
    rows = []
    for ra, rb in zip(a, b):
        texts = {r.index: r.text_sha256 for r in rb.results if r.success}
        both = [r for r in ra.results if r.success and r.index in texts]
        same = sum(1 for r in both if r.text_sha256 == texts[r.index])
        rows.append(f"{ra.summary.label:>14} same text {same} of {len(both)} requests answered by both")
    return "\n".join(rows)


def rescore(summary: RunSummary, results: Sequence[RequestResult], slo: Slo) -> RunSummary:
    """`summary` with its goodput under another SLO (same requests, same duration)."""
    num_good = sum(1 for r in results if slo.is_met(r))
    goodput = num_good / summary.duration_s if summary.duration_s > 0 else 0.0
    return dataclasses.replace(summary, slo=slo, num_good=num_good, goodput=goodput)


# ---------------------------------------------------------------- text


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def format_table(summaries: Sequence[RunSummary]) -> str:
    head = (f"{'run':<18}{'ok/all':>9}{'req/s':>8}{'tok/s':>9}{'goodput':>9}"
            f"{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>8}{'e2e p99':>10}")
    lines = [head, "-" * len(head)]
    for s in summaries:
        lines.append(
            f"{s.label:<18}{f'{s.num_succeeded}/{s.num_requests}':>9}"
            f"{s.request_throughput:>8.2f}{s.output_throughput:>9.1f}{s.goodput:>9.2f}"
            f"{_fmt(s.ttft.p50_ms):>10}{_fmt(s.ttft.p99_ms):>9}"
            f"{_fmt(s.tpot.p50_ms):>10}{_fmt(s.tpot.p99_ms):>8}{_fmt(s.e2e.p99_ms):>10}")
    if summaries:
        slo = summaries[0].slo
        lines.append(f"latencies in ms; goodput in req/s under TTFT <= {slo.ttft_ms:g} ms "
                     f"and TPOT <= {slo.tpot_ms:g} ms")
    for s in summaries:
        for message, count in s.errors:
            lines.append(f"{s.label}: {count} x {message}")
    return "\n".join(lines)


# ---------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(runs: Sequence[BenchRun], path: Path) -> Path:
    """TTFT, TPOT and e2e CDFs, one line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("TTFT (ms)", lambda r: r.ttft_s), ("TPOT (ms)", lambda r: r.tpot_s),
              ("end-to-end latency (ms)", lambda r: r.e2e_s))
    for ax, (title, pick) in zip(axes, panels):
        for run in runs:
            values = sorted(v * 1000.0 for r in run.results if r.success
                            and (v := pick(r)) is not None)
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=run.summary.label)
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    if runs:  # an SLO far beyond the data would squash the curves: draw it only when near
        slo = runs[0].summary.slo
        for ax, limit in ((axes[0], slo.ttft_ms), (axes[1], slo.tpot_ms)):
            if ax.lines and limit <= 1.5 * ax.get_xlim()[1]:
                ax.axvline(limit, color="grey", linestyle="--", linewidth=1, label="SLO")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_against_load(series: Mapping[str, Sequence[RunSummary]], path: Path,
                      title: str = "") -> Path:
    """p99 TTFT, p99 TPOT and goodput against offered load, one line per series
    (one series for a sweep; one per setup for the disaggregation experiment).
    Runs with an infinite rate have no place on the axis and are left out."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    xlabel = "request rate (req/s)"
    slo = None
    for name, summaries in series.items():
        points = sorted((s for s in summaries if math.isfinite(s.load)), key=lambda s: s.load)
        if not points:
            continue
        slo = points[0].slo
        if points[0].arrival == "closed":
            xlabel = "concurrency"
        xs = [s.load for s in points]
        style = dict(marker="o", label=name or None)
        axes[0].plot(xs, [_nan(s.ttft.p99_ms) for s in points], **style)
        axes[1].plot(xs, [_nan(s.tpot.p99_ms) for s in points], **style)
        axes[2].plot(xs, [s.goodput for s in points], **style)
    if slo is not None:
        axes[0].axhline(slo.ttft_ms, color="grey", linestyle="--", linewidth=1)
        axes[1].axhline(slo.tpot_ms, color="grey", linestyle="--", linewidth=1)
    for ax, ylabel in zip(axes, ("TTFT p99 (ms)", "TPOT p99 (ms)", "goodput (req/s)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    if any(name for name in series):  # a lone unnamed sweep needs no legend
        axes[2].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, plt, path)


def _nan(v: float | None) -> float:
    return math.nan if v is None else v


def _save(fig, plt, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

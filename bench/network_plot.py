"""The plot of `pdserve bench network`: TTFT per link rate, one line per way of serving.

x: the link rates in the order run (categories: "unshaped" has no place on a numeric axis);
y: each mode's median TTFT, a bar from its fastest to its slowest sample. Under each rate,
where the router put the prompts when it chose. matplotlib (the `bench` extra) is imported
only here; the file's format follows its suffix (.svg, .png, .pdf).
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Sequence

from pdserve.bench.network import Sample

MODE_STYLE = {"disaggregated": ("tab:blue", "o"), "local": ("tab:orange", "s"), "router": ("tab:green", "^")}


def _rate_label(rate: str, samples: Sequence[Sample]) -> str:
    """The rate's tick label, with the router's choices at that rate under it."""
    label = rate if rate == "unshaped" else f"{rate} Gbit/s"
    choices = sorted({"prefill host" if s.prefill_worker_id else "local"
                      for s in samples if s.mode == "router" and s.rate == rate})
    return label + (f"\nrouter: {' + '.join(choices)}" if choices else "")


def write_plot(samples: Sequence[Sample], rates: Sequence[str], path: str | Path, prompt_tokens: int) -> Path:
    """Write the plot of `samples` (measured at `rates`) to `path`; returns it. Text stays
    text in an SVG (searchable, and checked by the tests)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    modes = [m for m in MODE_STYLE if any(s.mode == m for s in samples)]
    with plt.rc_context({"svg.fonttype": "none"}):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for mode in modes:
            color, marker = MODE_STYLE[mode]
            xs, medians, low, high = [], [], [], []
            for x, rate in enumerate(rates):
                values = [s.ttft_s for s in samples if s.mode == mode and s.rate == rate]
                if values:
                    median = statistics.median(values)
                    xs.append(x)
                    medians.append(median)
                    low.append(median - min(values))
                    high.append(max(values) - median)
            ax.errorbar(xs, medians, yerr=[low, high], color=color, marker=marker, capsize=4, label=mode)
        ax.set_xticks(range(len(rates)), [_rate_label(r, samples) for r in rates])
        ax.set_xlabel("link rate (tc tbf, each way)")
        ax.set_ylabel("TTFT (s)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"TTFT of {prompt_tokens}-token prompts across hosts: median, min to max")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
    return path

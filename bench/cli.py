"""`pdserve bench WHAT ...`: hands the remaining arguments to `pdserve.bench.<module>:main`.

Each benchmark module is imported only when chosen, so `bench serve` never imports torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Sequence

# benchmark name -> module under pdserve.bench exposing main(argv: list[str]) -> int
BENCHMARKS = {
    "offline": "offline",  # engine throughput/latency without HTTP (engine issue)
    "transfer": "transfer",  # KV transfer backends (transfer issue)
    "serve": "serve",  # load generator for any OpenAI-compatible endpoint
    "experiment": "experiment",  # disaggregated vs colocated on this machine
    "kernels": "kernels",  # Triton kernels against their torch references
    "mixed-prefill": "mixed_prefill",  # prefill scheduling: a short prompt behind a long one
    "constrained": "constrained",  # grammar engines' per-token cost and constrained decode throughput
    "abuse": "abuse",  # a router under oversized prompts: small-chat latency, status counts, RSS
    "slowloris": "slow_clients",  # connections that never finish their headers: closed in time, /health fast
    "quantization": "quantization",  # each --quantization against fp32: agreement, perplexity, decode tok/s
    "gguf-1b": "synthetic_gguf",  # a synthetic ~1B GGUF: decode tok/s, fp32 vs its own blocks
    "int8dot-step": "int8dot_step",  # a step's integer-dot linears against a read of their bytes, one process
    "layerwise": "layerwise",  # a long prompt's KV streamed layer by layer vs sent whole: the transfer's tail
    "network": "network",  # prefill and decode on separate hosts (network namespaces): TTFT at shaped link rates
    "nemesis": "nemesis",  # 2 prefill + 2 decode hosts under cut links and killed workers: every request ends right
    "plan-check": "plan_check",  # pdserve plan's predictions against bench serve on pdserve up
    "plan-scale": "plan_scale",
    "lora": "lora",  # c8 decode mixing the base model and LoRA adapters against base-only: tokens/s  # pdserve plan for 8 to 512 GPUs on a GPU profile: best xPyD, link bandwidth
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows a flag's default where its help does not already say it, and never "None"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, "", argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: {action.default})"


class BenchmarkUnavailable(Exception):
    """The chosen benchmark's module is not part of this installation."""


def load(what: str) -> Callable[[list[str]], int]:
    """The `main` of benchmark `what`; BenchmarkUnavailable if it does not exist."""
    if what not in BENCHMARKS:
        raise BenchmarkUnavailable(f"unknown benchmark {what!r}; choose from {sorted(BENCHMARKS)}")
    name = f"pdserve.bench.{BENCHMARKS[what]}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:  # the module exists but one of its imports is missing: say so
            raise
        raise BenchmarkUnavailable(
            f"'pdserve bench {what}' is not available in this installation ({name} is missing)"
        ) from None
    fn = getattr(module, "main", None)
    if not callable(fn):
        raise BenchmarkUnavailable(f"{name} has no main(argv) function")
    return fn


def main(what: str, rest: Sequence[str]) -> int:
    try:
        fn = load(what)
    except BenchmarkUnavailable as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    return int(fn(list(rest)) or 0)

"""`pdserve bench network`: TTFT of long prompts with prefill and decode on separate hosts of
the network lab (`pdserve.lab`), at tc-shaped link rates, disaggregated against the decode's
own prefill; a table of medians and, with `--plot`, a chart (`network_plot`)."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from pdserve.lab.hosts import Lab
from pdserve.lab.namespaces import LabError, unavailable
from pdserve.lab.services import Deployment, deploy

MODES = {  # router flags of each way to serve a long prompt
    "disaggregated": ("--local-prefill-threshold", "0", "--static-routing"),
    "local": ("--local-prefill-threshold", "1000000000"),  # the decode's own prefill
    "router": (),  # the router's own choice, from its TTFT prediction
}


@dataclass(frozen=True, slots=True)
class Sample:
    mode: str
    rate: str
    ttft_s: float
    transfer_bytes: int
    transfer_ms: float
    decode_rx_bytes: int
    prefill_worker_id: str  # empty: the decode prefilled locally
    prefill_reason: str


def parse_rate(text: str) -> float | None:
    """'0.2' (Gbit/s) -> bits/s; 'unshaped' -> None."""
    return None if text.strip() == "unshaped" else float(text) * 1e9


def stream_ttft(cluster: Deployment, body: dict, timeout_s: float = 300.0) -> tuple[float, dict]:
    """Seconds from sending a streamed completion to its first token's chunk, and the
    request's `pdserve` extras merged over its chunks."""
    req = urllib.request.Request(cluster.url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", **cluster.admin_headers()})
    extras: dict = {}
    first = None
    started = time.perf_counter()
    with cluster.lab.inside(cluster.router.host.name), urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter() - started
            for key, value in (chunk.get("pdserve") or {}).items():
                extras.setdefault(key, value)
    if first is None:
        raise LabError(f"no token came back: {extras}")
    return first, extras


def long_prompts(num_tokens: int, count: int) -> list[str]:
    """`count` prompts of about `num_tokens` tokens that share no prefix block (each starts
    with its own number), so no prefix cache serves one from another."""
    from pdserve.engine.loader import load_model

    tok = load_model("default").tokenizer
    words = "the quick brown fox jumps over a lazy dog near seven quiet rivers and tall green hills".split()
    body = " ".join(f"{words[i % len(words)]}{i % 97}" for i in range(num_tokens))
    body = tok.decode(tok(body).input_ids[: num_tokens - 24])
    return [f"Request {i} of run {os.getpid()}-{time.time_ns()}: {body} Summarize." for i in range(count)]


def measure(mode: str, rates: Sequence[str], prompts: Iterator[str], repeats: int, worker_args: Sequence[str],
            secret_file: str, max_tokens: int) -> list[Sample]:
    """One deployment serving in `mode`; `repeats` prompts at each link rate."""
    samples = []
    with Lab(["router", "prefill", "decode"]) as lab:
        cluster = deploy(lab, secret_file, "router", ["prefill"], ["decode"], MODES[mode], worker_args)
        model = cluster.request("/v1/models")["data"][0]["id"]
        stream_ttft(cluster, {"model": model, "prompt": "Warm up.", "max_tokens": 1, "temperature": 0})
        for rate in rates:
            for host in lab.hosts:
                lab.shape(host, parse_rate(rate))
            for _ in range(repeats):
                before = lab.counters("decode")
                ttft, extras = stream_ttft(cluster, {"model": model, "prompt": next(prompts),
                                                     "max_tokens": max_tokens, "temperature": 0})
                crossed = lab.counters("decode") - before
                transfer, routing = extras.get("transfer") or {}, extras.get("routing") or {}
                samples.append(Sample(mode, rate, ttft, int(transfer.get("bytes", 0)),
                                      float(transfer.get("duration_ms", 0.0)), crossed.rx_bytes,
                                      routing.get("prefill_worker_id", ""), routing.get("prefill_reason", "")))
                print(f"  {samples[-1]}", flush=True)
        cluster.wait_idle()
        cluster.stop()
    return samples


def table(samples: Sequence[Sample], rates: Sequence[str]) -> str:
    """Median TTFT per rate and mode, the KV bytes that crossed, and where disaggregation pays."""
    def median_of(mode: str, rate: str, attr: str = "ttft_s") -> float | None:
        values = [getattr(s, attr) for s in samples if s.mode == mode and s.rate == rate]
        return statistics.median(values) if values else None

    lines = [f"{'rate Gbit/s':>12} {'disagg TTFT s':>14} {'local TTFT s':>13} {'KV MB':>7} {'decode rx MB':>13} "
             f"{'transfer ms':>12}  router's choice"]
    pays = []
    for rate in rates:
        d, loc = median_of("disaggregated", rate), median_of("local", rate)
        kv, rx, ms = (median_of("disaggregated", rate, a) for a in ("transfer_bytes", "decode_rx_bytes", "transfer_ms"))
        choice = sorted({f"{'prefill host' if s.prefill_worker_id else 'local'} ({s.prefill_reason})"
                         for s in samples if s.mode == "router" and s.rate == rate})
        cell = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        lines.append(f"{rate:>12} {cell(d, '14.2f')} {cell(loc, '13.2f')} {cell(kv and kv / 1e6, '7.1f')} "
                     f"{cell(rx and rx / 1e6, '13.1f')} {cell(ms, '12.0f')}  {', '.join(choice) or '-'}")
        if d is not None and loc is not None:
            pays.append((rate, d < loc))
    paying = [r for r, ok in pays if ok]
    lines.append("disaggregation pays (lower median TTFT than the decode's own prefill) at: "
                 + (", ".join(paying) if paying else "none of these rates"))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench network", description=(
        "TTFT of long prompts with prefill and decode on separate hosts (network namespaces, "
        "UCX over TCP) at tc-shaped link rates: disaggregated vs the decode's own prefill. "
        "Link delay is not emulated (no netem). Needs root and iproute2."))
    p.add_argument("--rates", default="0.2,1,10,unshaped", help="link rates in Gbit/s, or 'unshaped' (default %(default)s)")
    p.add_argument("--modes", default="disaggregated,local", help=f"of {','.join(MODES)} (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=2048, help="tokens per prompt (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="prompts per rate and mode (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens generated per prompt (default %(default)s)")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per worker (default %(default)s)")
    p.add_argument("--json", help="also write the samples to this file")
    p.add_argument("--plot", help="also plot TTFT per rate and mode to this file (.svg, .png or .pdf; needs "
                                  "matplotlib, the bench extra)")
    args = p.parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib: pip install 'pdserve[bench]'")
    reason = unavailable()
    if reason:
        print(f"pdserve bench network: {reason}", file=sys.stderr)
        return 2
    from pdserve.security.secret import ClusterSecret

    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}")
    import tempfile

    worker_args = ["--kv-backends", "ucx", "--failure-policy", "fail", "--num-threads", str(args.num_threads),
                   "--max-kv-tokens", str(4 * args.prompt_tokens), "--heartbeat-s", "0.5",
                   "--transfer-timeout-s", "120", "--prefill-timeout-s", "300"]
    prompts = iter(long_prompts(args.prompt_tokens, len(rates) * len(modes) * args.repeats))
    samples: list[Sample] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-netlab-") as tmp:
        secret = os.path.join(tmp, "cluster-secret")
        ClusterSecret.create(secret)
        for mode in modes:
            print(f"{mode}:", flush=True)
            samples += measure(mode, rates, prompts, args.repeats, worker_args, secret, args.max_tokens)
    print(table(samples, rates))
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(s) for s in samples], indent=1))
    if args.plot:
        from pdserve.bench.network_plot import write_plot

        print(f"plot: {write_plot(samples, rates, args.plot, args.prompt_tokens)}")
    return 0

"""The load a plan is for: a recorded trace, or `bench serve`'s random workload.

A trace is JSON lines, one request per line, in arrival order:

    {"arrival_s": 0.0, "input_len": 812, "output_len": 128}
    {"arrival_s": 0.41, "input_len": 95, "output_len": 64, "cached_len": 32}

`arrival_s` is seconds after the trace starts, `input_len` the prompt's tokens, `output_len`
the tokens generated, `cached_len` (optional) the prompt tokens a prefix cache already held.
Blank lines and lines starting with `#` are skipped. `pdserve bench serve --trace-out` records
one (`write_trace`).
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from pdserve.common.errors import InvalidRequestError


class TraceError(InvalidRequestError):
    """A trace file is unreadable or one of its lines is malformed (the message names it)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_len: int
    output_len: int
    cached_len: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise TraceError(f"arrival_s must be a finite number >= 0, not {self.arrival_s!r}")
        if self.input_len < 1 or self.output_len < 1:
            raise TraceError("input_len and output_len must be >= 1")
        if not 0 <= self.cached_len < self.input_len:
            raise TraceError("cached_len must be in [0, input_len)")


def random_workload(request_rate: float, input_len: int, output_len: int, num_requests: int,
                    seed: int = 0) -> tuple[TraceRequest, ...]:
    """Poisson arrivals at `request_rate` req/s of fixed lengths, as `bench serve --arrival
    poisson --input-len N --output-len M` sends them (`inf`: all at once)."""
    if not request_rate > 0:
        raise TraceError("request rate must be > 0")
    rng = random.Random(f"pdserve-plan:{seed}")
    out, t = [], 0.0
    for _ in range(num_requests):
        out.append(TraceRequest(t, input_len, output_len))
        if math.isfinite(request_rate):
            t += rng.expovariate(request_rate)
    return tuple(out)


def mixed_workload(request_rate: float, lengths: Sequence[tuple[float, int, int]], num_requests: int,
                   seed: int = 0) -> tuple[TraceRequest, ...]:
    """Poisson arrivals whose (input, output) lengths are drawn log-uniformly around each class's
    mean, the class by weight: `lengths` is (weight, mean input, mean output) per class."""
    rng = random.Random(f"pdserve-plan-mix:{seed}")
    weights = [w for w, _, _ in lengths]
    out, t = [], 0.0
    for _ in range(num_requests):
        _, mean_in, mean_out = rng.choices(lengths, weights)[0]
        out.append(TraceRequest(t, _spread(mean_in, rng), _spread(mean_out, rng)))
        t += rng.expovariate(request_rate)
    return tuple(out)


def _spread(mean: int, rng: random.Random) -> int:
    """A length between half and one and a half times `mean` (mean preserved), at least 1."""
    return max(1, round(mean * rng.uniform(0.5, 1.5)))


def scaled(trace: Sequence[TraceRequest], factor: float) -> tuple[TraceRequest, ...]:
    """The same requests arriving `factor` times as fast (factor > 1: more load)."""
    return tuple(TraceRequest(r.arrival_s / factor, r.input_len, r.output_len, r.cached_len) for r in trace)


def read_trace(path: str | Path) -> tuple[TraceRequest, ...]:
    """The requests of a trace file, sorted by arrival; TraceError names the file and line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"trace {path}: {exc}") from None
    out = [_parse_line(f"{path}:{n}", line) for n, line in enumerate(lines, 1)
           if line.strip() and not line.lstrip().startswith("#")]
    if not out:
        raise TraceError(f"trace {path}: no requests")
    out.sort(key=lambda r: r.arrival_s)
    start = out[0].arrival_s
    return tuple(TraceRequest(r.arrival_s - start, r.input_len, r.output_len, r.cached_len) for r in out)


def _parse_line(where: str, line: str) -> TraceRequest:
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise TraceError(f"{where}: not JSON ({exc})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: expected an object with arrival_s, input_len, output_len")
    try:
        values = {k: row[k] for k in ("arrival_s", "input_len", "output_len")}
    except KeyError as exc:
        raise TraceError(f"{where}: missing {exc.args[0]!r}") from None
    values["cached_len"] = row.get("cached_len", 0)
    for key in ("input_len", "output_len", "cached_len"):
        if isinstance(values[key], bool) or not isinstance(values[key], int):
            raise TraceError(f"{where}: {key} must be an integer, not {values[key]!r}")
    if isinstance(values["arrival_s"], bool) or not isinstance(values["arrival_s"], (int, float)):
        raise TraceError(f"{where}: arrival_s must be a number, not {values['arrival_s']!r}")
    try:
        return TraceRequest(float(values["arrival_s"]), values["input_len"], values["output_len"],
                            values["cached_len"])
    except TraceError as exc:
        raise TraceError(f"{where}: {exc}") from None


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in sorted(requests, key=lambda r: r.arrival_s):
            row = {"arrival_s": round(r.arrival_s, 6), "input_len": r.input_len, "output_len": r.output_len}
            if r.cached_len:
                row["cached_len"] = r.cached_len
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    return path


def mean_lengths(trace: Sequence[TraceRequest]) -> tuple[float, float, float]:
    """(request rate, mean input length, mean output length) of a trace."""
    span = trace[-1].arrival_s - trace[0].arrival_s if len(trace) > 1 else 0.0
    rate = (len(trace) - 1) / span if span > 0 else math.inf
    return (rate, sum(r.input_len for r in trace) / len(trace), sum(r.output_len for r in trace) / len(trace))

"""A profile: what one model costs on one device kind, as the simulator needs it.

Written by `pdserve profile` (measured with the engine) or by hand from published figures
(then `source` says so). The simulator prices each engine step with `StepCost`, a linear model
of the step's work fitted to the measured steps:

    seconds = base_s
            + prefill_token_s * (prompt tokens computed this step)
            + prefill_attention_s * sum over prompt chunks of tokens x (context before them + tokens / 2)
            + decode_seq_s * (sequences decoding this step)
            + decode_context_s * (their context tokens, summed)

A step that decodes is priced, where the profile measured decode steps (`decode_table`), by
the measured step of that batch size at that context per sequence (interpolated, `DecodeTable`)
plus the linear model's prompt terms: a linear fit over every step pays a batch of one the
intercept that long prompt steps need, and a decode step of a small batch costs far less.

A served worker does more than its engine's step: it streams each step's tokens to the router,
which streams them on to the client, on the same cores where workers share a host.
`served_step_s` adds that to every step; `pdserve profile` times the engine alone and writes 0,
and `pdserve bench plan-check --fit-served-step` reports the value its measurement implies.

A profile carries the KV compatibility hash of the engine that measured it (`compat_hash`,
hex): a plan for another model or other weights refuses it (`check_compatible`). The JSON is
read with every field checked; nothing in it is executed.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

from pdserve.common.errors import InvalidRequestError

PROFILE_VERSION = 1


class ProfileError(InvalidRequestError):
    """A profile file is unreadable, malformed, or of another model than the one planned for."""


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds of one engine step as a linear function of its work (module docstring)."""

    base_s: float
    prefill_token_s: float
    prefill_attention_s: float
    decode_seq_s: float
    decode_context_s: float

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ProfileError(f"step cost {f.name} must be a finite number >= 0, not {value!r}")

    def seconds(self, prefill_tokens: int, prefill_attention: float, num_decode: int,
                decode_context: int) -> float:
        return (self.base_s + self.prefill_token_s * prefill_tokens
                + self.prefill_attention_s * prefill_attention
                + self.decode_seq_s * num_decode + self.decode_context_s * decode_context)

    def prefill_s(self, num_tokens: int, num_cached: int = 0) -> float:
        """One prompt's uncached `num_tokens` in one step after `num_cached` cached tokens."""
        return self.seconds(num_tokens, num_tokens * (num_cached + num_tokens / 2), 0, 0)

    def scaled(self, factor: float) -> "StepCost":
        return StepCost(*(getattr(self, f.name) * factor for f in fields(self)))


@dataclass(frozen=True, slots=True)
class DecodeTable:
    """Measured decode steps, (batch size, context tokens per sequence, seconds) each: a
    step's seconds are interpolated linearly in batch size at each measured context, then
    linearly in context between them; outside the measured range the nearest segment
    continues, never below the cheapest step measured."""

    points: tuple[tuple[int, int, float], ...]

    def __post_init__(self) -> None:
        for point in self.points:
            if len(point) != 3 or not (point[0] >= 1 and point[1] >= 0 and math.isfinite(point[2])
                                       and point[2] > 0):
                raise ProfileError(f"decode table point {point!r}: need (batch >= 1, context >= 0, seconds > 0)")
        contexts = {c for _, c, _ in self.points}
        for context in contexts:
            if len({b for b, c, _ in self.points if c == context}) < 2:
                raise ProfileError(f"decode table: context {context} needs two batch sizes or more")

    def seconds(self, batch: int, context_per_seq: float) -> float:
        contexts = sorted({c for _, c, _ in self.points})
        rows = [(c, _interpolate([(b, s) for b, cc, s in self.points if cc == c], batch)) for c in contexts]
        value = _interpolate(rows, context_per_seq) if len(rows) > 1 else rows[0][1]
        return max(value, min(s for _, _, s in self.points))


def _interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise linear through `points` (sorted here); the end segments continue past them."""
    pts = sorted(points)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1 or (x1, y1) == pts[-1]:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y1
    return pts[0][1]


@dataclass(frozen=True, slots=True)
class TransferCost:
    """One KV backend's link: the KV of N bytes takes `tail_s + N / bytes_per_s` past the
    forward when sent whole; streamed layer by layer it hides behind the forward up to the
    forward's length (the router's `transfer_cost` rule)."""

    backend: str
    bytes_per_s: float
    tail_s: float

    def __post_init__(self) -> None:
        if not (self.bytes_per_s > 0 and math.isfinite(self.bytes_per_s)):
            raise ProfileError(f"transfer {self.backend}: bytes_per_s must be > 0")
        if not (self.tail_s >= 0 and math.isfinite(self.tail_s)):
            raise ProfileError(f"transfer {self.backend}: tail_s must be >= 0")

    def past_forward_s(self, num_bytes: float, forward_s: float, layerwise: bool = True) -> float:
        wire = num_bytes / self.bytes_per_s
        return max(self.tail_s, wire - forward_s) if layerwise else self.tail_s + wire


@dataclass(frozen=True, slots=True)
class Machine:
    """Where a profile was measured."""

    cpu_model: str = ""
    num_cores: int = 0
    isa_flags: tuple[str, ...] = ()
    accelerator: str = ""  # "" on CPU; e.g. "NVIDIA H100 80GB SXM"
    memory_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Profile:
    """One model on one device kind. A "device" is what a worker occupies: `threads` cores on
    CPU, `devices_per_worker` GPUs on GPU; a budget of D devices runs D // devices_per_worker
    workers."""

    model: str
    compat_hash: str  # hex of the engine's KV compatibility hash ("" = unknown: never checked)
    device: str  # "cpu" | "cuda"
    source: str  # "measured by pdserve profile ..." or the published figures it was built from
    step: StepCost
    kv_bytes_per_token: int
    kv_tokens: int  # KV capacity of one worker at the default free-memory fraction
    block_size: int = 16
    max_model_len: int = 2048
    threads: int = 1  # CPU: intra-op threads of the worker measured
    devices_per_worker: int = 1
    spec_tokens_per_step: float = 1.0  # tokens a decoding sequence gains per step (speculation)
    transfers: tuple[TransferCost, ...] = ()
    kv_tokens_by_fraction: tuple[tuple[float, int], ...] = ()  # (free_memory_fraction, tokens)
    machine: Machine = field(default_factory=Machine)
    samples: Mapping[str, Any] = field(default_factory=dict)  # the raw measurements, for the record
    created: str = ""
    decode_table: DecodeTable | None = None  # measured decode steps (None: `step` prices them)
    served_step_s: float = 0.0  # what a served worker adds to each step (module docstring)

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0 or self.kv_tokens < self.block_size:
            raise ProfileError("a profile needs kv_bytes_per_token > 0 and room for one KV block")
        if self.spec_tokens_per_step < 1:
            raise ProfileError("spec_tokens_per_step must be >= 1")
        if self.devices_per_worker < 1 or self.threads < 1:
            raise ProfileError("devices_per_worker and threads must be >= 1")
        if not (isinstance(self.served_step_s, (int, float)) and 0 <= self.served_step_s < 10):
            raise ProfileError(f"served_step_s must be seconds in [0, 10), not {self.served_step_s!r}")

    def step_seconds(self, prefill_tokens: int, prefill_attention: float, num_decode: int,
                     decode_context: int) -> float:
        """One engine step's seconds (module docstring): the decode table's step for the
        decoding sequences plus the prompt terms, or the linear model alone."""
        step = self.step
        if not num_decode or self.decode_table is None:
            return self.served_step_s + step.seconds(prefill_tokens, prefill_attention, num_decode, decode_context)
        return (self.served_step_s + self.decode_table.seconds(num_decode, decode_context / num_decode)
                + step.prefill_token_s * prefill_tokens + step.prefill_attention_s * prefill_attention)

    def transfer(self, backend: str | None = None) -> TransferCost | None:
        """The named backend's link, or the fastest one measured (None: none measured)."""
        if backend:
            return next((t for t in self.transfers if t.backend == backend), None)
        return max(self.transfers, key=lambda t: t.bytes_per_s, default=None)

    def check_compatible(self, compat_hash: str) -> None:
        """ProfileError unless this profile was measured for the model whose hash is given."""
        if self.compat_hash and compat_hash and self.compat_hash != compat_hash:
            raise ProfileError(
                f"profile of {self.model!r} (compatibility hash {self.compat_hash}) is for another "
                f"model or other weights than the one planned for (hash {compat_hash}): "
                f"run `pdserve profile` for that model")

    def to_json(self) -> str:
        doc = {"version": PROFILE_VERSION, **asdict(self)}
        return json.dumps(doc, indent=1, allow_nan=False)


def save_profile(profile: Profile, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(profile.to_json())
    tmp.replace(path)
    return path


def load_profile(path: str | Path) -> Profile:
    """Read a profile written by `save_profile` (or by hand in that shape); ProfileError names
    the file and the field that is wrong."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ProfileError(f"profile {path}: {exc}") from None
    try:
        return profile_from_dict(doc)
    except ProfileError as exc:
        raise ProfileError(f"profile {path}: {exc}") from None


def profile_from_dict(doc: Any) -> Profile:
    if not isinstance(doc, dict):
        raise ProfileError("expected a JSON object")
    if doc.get("version") != PROFILE_VERSION:
        raise ProfileError(f"version {doc.get('version')!r} is not {PROFILE_VERSION}")
    try:
        step = StepCost(**_fields(doc["step"], StepCost))
        transfers = tuple(TransferCost(**_fields(t, TransferCost)) for t in doc.get("transfers", ()))
        machine = Machine(**{**_fields(doc.get("machine", {}), Machine, required=False)})
        machine = Machine(**{**asdict(machine), "isa_flags": tuple(machine.isa_flags)})
        by_fraction = tuple((float(f), int(t)) for f, t in doc.get("kv_tokens_by_fraction", ()))
        plain = {f.name: doc[f.name] for f in fields(Profile)
                 if f.name in doc and f.name not in ("step", "transfers", "machine", "kv_tokens_by_fraction",
                                                     "decode_table")}
        return Profile(**{**plain, "step": step, "transfers": transfers, "machine": machine,
                          "kv_tokens_by_fraction": by_fraction, "decode_table": _decode_table(doc)})
    except KeyError as exc:
        raise ProfileError(f"missing field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ProfileError(str(exc)) from None


def _decode_table(doc: dict) -> DecodeTable | None:
    """The profile's decode table; a profile written before it had one gets it from its
    decode samples; one without either has none."""
    table = doc.get("decode_table")
    if isinstance(table, dict):
        points = table.get("points", ())
    else:
        decode = doc.get("samples", {}).get("decode", ()) if isinstance(doc.get("samples"), dict) else ()
        points = [(d["batch"], d["context"], d["step_s"]) for d in decode
                  if isinstance(d, dict) and d.get("step_s", 0) > 0] if table is None else ()
    if not points:
        return None
    try:
        return DecodeTable(tuple((int(b), int(c), float(s)) for b, c, s in points))
    except ProfileError:
        if table is not None:
            raise
        return None  # samples too few to interpolate: the linear model prices decode steps


def _fields(doc: Any, cls: type, required: bool = True) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ProfileError(f"{cls.__name__}: expected an object")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(doc) - names)
    if unknown:
        raise ProfileError(f"{cls.__name__}: unknown fields {unknown}")
    return dict(doc)


def fit_step_cost(rows: Sequence[tuple[float, float, float, float, float]]) -> StepCost:
    """The non-negative least-squares `StepCost` of measured steps, each row
    (prefill tokens, prefill attention work, decoding sequences, their context tokens, seconds)."""
    import numpy as np
    from scipy.optimize import nnls

    if len(rows) < 5:
        raise ProfileError(f"{len(rows)} measured steps are too few to fit a step cost (need 5)")
    data = np.asarray(rows, dtype=float)
    a = np.column_stack([np.ones(len(data)), data[:, :4]])
    scale = np.maximum(a.max(axis=0), 1e-12)  # columns to comparable size for the solver
    # absolute error: the fitted steps add up to the measured time, which is what queues see
    # (a fit of relative error under-prices the long steps that a busy machine stretches)
    coef, _ = nnls(a / scale, data[:, 4])
    return StepCost(*(float(c) for c in coef / scale))

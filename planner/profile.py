"""A profile: what one model costs on one device kind, as the simulator needs it.

Written by `pdserve profile` (measured with the engine) or by hand from published figures
(then `source` says so). The simulator prices each engine step with `StepCost`, a linear model
of the step's work fitted to the measured steps:

    seconds = base_s
            + prefill_token_s * (prompt tokens computed this step)
            + prefill_attention_s * sum over prompt chunks of tokens x (context before them + tokens / 2)
            + decode_seq_s * (sequences decoding this step)
            + decode_context_s * (their context tokens, summed)

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

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0 or self.kv_tokens < self.block_size:
            raise ProfileError("a profile needs kv_bytes_per_token > 0 and room for one KV block")
        if self.spec_tokens_per_step < 1:
            raise ProfileError("spec_tokens_per_step must be >= 1")
        if self.devices_per_worker < 1 or self.threads < 1:
            raise ProfileError("devices_per_worker and threads must be >= 1")

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
                 if f.name in doc and f.name not in ("step", "transfers", "machine", "kv_tokens_by_fraction")}
        return Profile(**{**plain, "step": step, "transfers": transfers, "machine": machine,
                          "kv_tokens_by_fraction": by_fraction})
    except KeyError as exc:
        raise ProfileError(f"missing field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ProfileError(str(exc)) from None


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

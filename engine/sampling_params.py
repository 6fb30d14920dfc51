"""Per-request sampling settings, validated once on construction."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.errors import InvalidRequestError
from pdserve.engine.constraints import Constraint

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 = off
    seed: int | None = None  # per-request generator: same seed, same tokens
    stop: tuple[str, ...] = ()  # stop strings; not part of the returned text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; N >= 0: chosen token's logprob + top N
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0  # in [-2, 2]: minus this once for every token already generated
    frequency_penalty: float = 0.0  # in [-2, 2]: minus this times each token's output count
    repetition_penalty: float = 1.0  # > 0; transformers' rule over prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    constraint: Constraint | None = None  # a grammar the output must follow (constraints.py)
    prompt_logprobs: int | None = None  # None: off; N >= 0: each prompt token's logprob + top N

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens must be in [0, max_tokens]")
        if not (self.temperature >= 0.0) or self.temperature > 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError("seed must be in [0, 2**63)")
        self._check_penalties()

    def _check_penalties(self) -> None:
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items()))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise InvalidRequestError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens")
        if any(not -100.0 <= b <= 100.0 or t < 0 for t, b in self.logit_bias):
            raise InvalidRequestError("logit_bias values must be in [-100, 100] for token ids >= 0")

    @property
    def has_logit_adjustments(self) -> bool:
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

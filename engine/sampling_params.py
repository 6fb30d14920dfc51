"""Per-request sampling settings: the sampling table's values (common.sampling, checked on
construction) and what only the engine uses."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.sampling import SamplingValues
from pdserve.engine.constraints import Constraint


@dataclass(frozen=True, slots=True)
class SamplingParams(SamplingValues):
    skip_special_tokens: bool = True
    constraint: Constraint | None = None  # a grammar the output must follow (constraints.py)

    @property
    def has_logit_adjustments(self) -> bool:
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

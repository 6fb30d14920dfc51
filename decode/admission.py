"""Conditional disaggregation: should this request's prompt be prefilled here or remotely?"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefillDecision:
    remote: bool
    reason: str  # goes into the verdict, logs and metrics


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    local_prefill_threshold: int  # uncached prompt tokens at or under which we prefill here
    prefill_queue_threshold: int  # prefill queue length at or over which we prefill here

    def decide(self, num_prompt_tokens: int, num_cached_tokens: int, prefill_address: str,
               router_reason: str, prefill_queue_length: int, can_receive: bool) -> PrefillDecision:
        if not prefill_address:
            return PrefillDecision(False, router_reason or "no_prefill_worker")
        if not can_receive:
            return PrefillDecision(False, "no_transfer_backend")
        if num_prompt_tokens - num_cached_tokens <= self.local_prefill_threshold:
            return PrefillDecision(False, "short_uncached_prompt")
        if prefill_queue_length >= self.prefill_queue_threshold:
            return PrefillDecision(False, "prefill_queue_long")
        return PrefillDecision(True, router_reason or "remote")

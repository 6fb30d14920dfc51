"""What the engine hands back: per-step deltas and, offline, whole completions."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from pdserve.engine.request import Request, TokenLogprob


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One request's progress in one engine step (a delta), or its end."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    new_logprobs: tuple[TokenLogprob, ...]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None  # the stop string or stop token id that ended it
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens found in the local prefix cache
    num_external_tokens: int  # prompt tokens loaded or received through a connector
    error: str | None = None
    num_loaded_tokens: int = 0  # of those, loaded from a connector's store (not received)
    # sampling_params.prompt_logprobs, on the request's first delta with tokens: one entry per
    # prompt token after the first
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    # time.monotonic() when the request's first chunk was scheduled and when its first token
    # was sampled here (None until then): the queue and prefill phases of a local prefill
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # speculative decoding so far: drafts checked for this request, and of those kept
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_steps: int = 0  # steps that checked drafts for it
    # prompt tokens found cached, by tier ("device", "host", "disk", "redis"), at first admission
    cached_tokens_by_tier: tuple[tuple[str, int], ...] = ()


def delta(request: Request, tokens: Sequence[int], text: str, logprobs: Sequence[TokenLogprob]) -> RequestOutput:
    """`request`'s delta: these new tokens (and their text and logprobs), with its state now.
    Its prompt's logprobs, when wanted, go with the first delta that carries tokens."""
    prompt_logprobs, spec = None, request.speculation  # spec: speculation.SequenceDrafts or None
    if tokens and request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
        prompt_logprobs, request.prompt_logprobs_sent = tuple(request.prompt_logprobs), True
    return RequestOutput(
        request.request_id, tuple(tokens), text, tuple(logprobs), request.is_finished,
        request.finish_reason, request.stop_reason, request.num_prompt_tokens,
        request.num_output_tokens, max(0, request.num_cached_tokens),
        request.num_external_tokens, num_loaded_tokens=request.num_loaded_tokens,
        prompt_logprobs=prompt_logprobs, first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time, num_draft_tokens=spec.num_draft_tokens if spec else 0,
        num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
        num_draft_steps=spec.num_draft_steps if spec else 0,
        cached_tokens_by_tier=tuple(sorted(request.cached_tokens_by_tier.items())))


def merge_deltas(deltas: Sequence[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request as one (a step that kept several tokens of it)."""
    last = deltas[-1]
    if len(deltas) == 1:
        return last
    return replace(last, new_token_ids=tuple(t for d in deltas for t in d.new_token_ids),
                   new_text="".join(d.new_text for d in deltas),
                   new_logprobs=tuple(lp for d in deltas for lp in d.new_logprobs),
                   prompt_logprobs=next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None))


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request, as the offline API returns it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None
    stop_reason: str | int | None
    num_cached_tokens: int
    num_external_tokens: int
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # see RequestOutput

    @property
    def num_computed_prompt_tokens(self) -> int:
        """Prompt tokens this engine actually ran through the model."""
        return len(self.prompt_token_ids) - self.num_cached_tokens - self.num_external_tokens


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_waiting_remote: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    num_prompt_tokens_computed: int  # prompt tokens run through the model, all requests
    num_generation_tokens: int
    num_prefix_queries: int = 0  # prompt tokens of admitted requests
    num_prefix_hits: int = 0  # of those, found in the prefix cache
    num_steps: int = 0  # steps that ran a forward
    step_seconds: float = 0.0  # their total time
    num_queued_prompt_tokens: int = 0  # prompt tokens of waiting and running requests not yet computed
    prefill_tokens_per_s: float = 0.0  # recent prompt tokens per second of forward time (0: none yet)
    num_decoding: int = 0  # running requests past their prompt
    # speculative decoding: drafts checked, drafts kept, and sequence-steps that checked drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verified_sequences: int = 0


class PrefillRate:
    """Prompt tokens computed per second of forward time, recently: an exponential average
    over steps that computed prompt tokens (weighted by their tokens), 0 until `min_tokens`
    have been computed (a few tokens time a step's fixed cost, not the rate). What the router
    predicts a worker's time to first token from."""

    __slots__ = ("tokens_per_s", "_half_life_tokens", "_min_tokens", "_first")

    def __init__(self, half_life_tokens: int = 2048, min_tokens: int = 64) -> None:
        self.tokens_per_s = 0.0
        self._half_life_tokens = half_life_tokens
        self._min_tokens = min_tokens
        self._first = [0, 0.0]  # tokens and seconds before the first rate

    def note(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        if self.tokens_per_s == 0:
            self._first[0] += tokens
            self._first[1] += seconds
            if self._first[0] >= self._min_tokens:
                self.tokens_per_s = self._first[0] / self._first[1]
            return
        keep = 0.5 ** (tokens / self._half_life_tokens)
        self.tokens_per_s = keep * self.tokens_per_s + (1 - keep) * rate

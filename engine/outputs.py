"""What the engine hands back: per-step deltas and, offline, whole completions."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.request import TokenLogprob


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

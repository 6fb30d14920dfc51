"""Token choice from logits: penalties and logit_bias, min_tokens, the grammar mask, then greedy,
temperature, top-k, top-p, seeded; logprobs."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.penalties import apply_adjustments
from pdserve.engine.request import Request, TokenLogprob


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None


def _suppress_stops(row: torch.Tensor, request: Request) -> None:
    """Before min_tokens, no stop token (eos or stop_token_ids) may be chosen."""
    p = request.sampling_params
    if request.num_output_tokens < p.min_tokens:
        ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(request.eos_token_ids))
        if ids:
            row[ids] = float("-inf")


_MASK63 = (1 << 63) - 1


def step_seed(seed: int, index: int) -> int:
    """The seed of a seeded request's `index`-th generated token (splitmix64 finalizer of
    seed and index). Per-token seeds, not one running stream, make a token's draw depend only
    on (seed, index, logits): the first token drawn by a prefill service and the rest drawn
    by decode give the same text as one local run."""
    x = (seed * 0x9E3779B97F4A7C15 + index + 1) & ((1 << 64) - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) & _MASK63


def _generator(request: Request):
    seed = request.sampling_params.seed
    if seed is not None:
        request.generator.manual_seed(step_seed(seed, request.num_output_tokens))
    return request.generator


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the best is always kept)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
    """logits: [N, vocab] fp32, row i for requests[i]."""
    apply_adjustments(logits, requests)
    for i, req in enumerate(requests):
        _suppress_stops(logits[i], req)
        allowed = req.grammar.allowed()
        if allowed is not None:
            logits[i, : allowed.shape[0]].masked_fill_(~allowed, float("-inf"))
    greedy = logits.argmax(dim=-1).tolist()
    need_logprobs = any(r.sampling_params.logprobs is not None for r in requests)
    logprobs = torch.log_softmax(logits, dim=-1) if need_logprobs else None
    out = []
    for i, req in enumerate(requests):
        p = req.sampling_params
        if p.is_greedy:
            token = greedy[i]
        else:
            row = _filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
            probs = row.softmax(-1)
            token = int(torch.multinomial(probs, 1, generator=_generator(req)).item())
        lp = None
        if p.logprobs is not None:
            row_lp = logprobs[i]
            top = ()
            if p.logprobs:
                vals, ids = torch.topk(row_lp, p.logprobs)
                top = tuple(zip(ids.tolist(), vals.tolist()))
            lp = TokenLogprob(token, float(row_lp[token]), top)
        out.append(SampledToken(token, lp))
    return out

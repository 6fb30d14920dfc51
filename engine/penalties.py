"""Logit adjustments a request asks for, applied before min_tokens, constraints and the draw:
`logit_bias` (added), the repetition penalty over prompt and output tokens (transformers'
RepetitionPenaltyLogitsProcessor: a positive logit is divided by it, a negative one
multiplied), then OpenAI's frequency and presence penalties over the output tokens
(logit -= frequency * count + presence * (count > 0))."""
from __future__ import annotations

import torch

from pdserve.engine.request import Request


def apply_adjustments(logits: torch.Tensor, requests: list[Request]) -> None:
    """logits: [N, vocab] fp32, row i for requests[i]; changed in place."""
    for i, request in enumerate(requests):
        p = request.sampling_params
        if p.has_logit_adjustments:
            _adjust_row(logits[i], request)


def _adjust_row(row: torch.Tensor, request: Request) -> None:
    p = request.sampling_params
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=row.device)
        row.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=row.device))
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.prompt_token_ids) | set(request.output_token_ids)),
                            device=row.device)
        values = row[seen]
        row[seen] = torch.where(values < 0, values * p.repetition_penalty, values / p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and request.output_token_ids:
        ids = torch.tensor(request.output_token_ids, device=row.device)
        counts = torch.bincount(ids, minlength=row.shape[-1])[: row.shape[-1]].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

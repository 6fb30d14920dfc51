"""Prompt-lookup proposals, the batch's choice of drafts, the step-cost fit and the
`--speculative-config` JSON, against hand-worked references."""
from __future__ import annotations

import numpy as np
import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.speculation import Candidate, SequenceDrafts, StepCost, TokenHistory, choose_drafts, propose


def arr(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


@pytest.mark.parametrize("tokens, min_n, max_n, k, expected", [
    # the last 2 tokens (7, 8) occur at 1: what followed them
    ((5, 7, 8, 9, 10, 11, 7, 8), 2, 3, 3, (9, 10, 11)),
    # the longest n wins: (3, 4) occurs twice, (2, 3, 4) once, followed by 9
    ((2, 3, 4, 9, 3, 4, 5, 2, 3, 4), 2, 3, 2, (9, 3)),
    # the latest occurrence of the longest match
    ((1, 2, 6, 1, 2, 7, 1, 2), 2, 2, 1, (7,)),
    # at most what follows the occurrence: the sequence's own end
    ((4, 4, 4), 1, 2, 5, (4,)),
    # no occurrence of n >= min_n: nothing
    ((1, 2, 3, 4, 5, 3), 2, 4, 3, ()),
    ((1, 2, 3, 4, 5, 3), 1, 4, 2, (4, 5)),
    # too short to hold an earlier occurrence
    ((9,), 1, 3, 3, ()),
])
def test_propose_copies_what_followed_the_latest_longest_match(tokens, min_n, max_n, k, expected):
    assert tuple(propose(arr(*tokens), min_n, max_n, k).tolist()) == expected


def test_propose_looks_back_only_its_window_whatever_the_context():
    """Issue 48, item 7: the lookup ran over the whole history on the engine thread every
    step (21 ms per sequence at 131k tokens). It searches the newest LOOKUP_WINDOW tokens:
    a match older than that is not proposed; the same match inside the window is."""
    from pdserve.engine.speculation import LOOKUP_WINDOW

    rng = np.random.default_rng(5)
    context = rng.integers(1000, 30000, 131_072).astype(np.int32)
    context[100:104] = [7, 8, 9, 10]  # far back: 7 8 followed by 9 10
    context[-2:] = [7, 8]
    assert propose(context, 2, 4, 2).size == 0
    assert tuple(propose(context, 2, 4, 2, window=context.shape[0]).tolist()) == (9, 10)
    context[-LOOKUP_WINDOW + 10:-LOOKUP_WINDOW + 14] = [7, 8, 11, 12]  # just inside the window
    assert tuple(propose(context, 2, 4, 2).tolist()) == (11, 12)


def test_history_tracks_prompt_then_output_as_it_grows():
    class Req:
        prompt_token_ids = [1, 2, 3]
        output_token_ids: list[int] = []

        @property
        def num_tokens(self):
            return len(self.prompt_token_ids) + len(self.output_token_ids)

        def token_id_at(self, p):
            n = len(self.prompt_token_ids)
            return self.prompt_token_ids[p] if p < n else self.output_token_ids[p - n]

    req, history = Req(), TokenHistory()
    assert history.sync(req).tolist() == [1, 2, 3]
    req.output_token_ids = list(range(10, 400))  # past the first buffer's 256
    assert history.sync(req).tolist() == [1, 2, 3] + list(range(10, 400))


def test_choose_drafts_weighs_every_sequence_of_the_step():
    sure = Candidate(0, (5, 6, 7, 8), keep_rate=0.95)
    unlikely = Candidate(1, (9, 9), keep_rate=0.05)
    # alone, a sure sequence runs every draft: each raises its tokens per unit of time
    assert choose_drafts([sure], ratio=0.2, num_rows=1, num_samples=1, max_rows=64) == {0: 4}
    # beside another sequence, whose time per token each row lengthens: T * sum(1/n) is
    # 1.6 * (1/1.95 + 1) = 2.42 with one draft, 1.8 * (1/2.85 + 1) = 2.43 with two
    assert choose_drafts([sure, unlikely], ratio=0.2, num_rows=2, num_samples=2, max_rows=64) == {0: 1}


def test_choose_drafts_reference_for_one_sequence():
    # one row costs 0.2 of a step's fixed part: draft j (kept with 0.5**j) pays while
    # 0.5**j * (1 + 0.2 R) > 0.2 * tokens. j=1: 0.5*1.2 > 0.2 -> tokens 1.5, R 2;
    # j=2: 0.25*1.4 = 0.35 > 0.3 -> tokens 1.75, R 3; j=3: 0.125*1.6 = 0.2 < 0.35: stop
    taken = choose_drafts([Candidate(3, (1, 2, 3, 4), 0.5)], ratio=0.2, num_rows=1, num_samples=1, max_rows=64)
    assert taken == {3: 2}


def test_choose_drafts_runs_plainly_when_rows_cost_more_than_they_give():
    # 8 sequences decode: a first draft kept with chance p must give p/(1+p) > 0.2*8/2.8 = 0.57,
    # more than any chance can
    batch = [Candidate(i, (1, 2, 3), 0.99) for i in range(8)]
    assert choose_drafts(batch, ratio=0.2, num_rows=8, num_samples=8, max_rows=64) == {}
    # where rows are nearly free (a GPU's small batches), sure drafts all run
    assert choose_drafts(batch, ratio=0.001, num_rows=8, num_samples=8, max_rows=64) == {i: 3 for i in range(8)}
    assert choose_drafts(batch, ratio=0.0, num_rows=8, num_samples=8, max_rows=64) == {i: 3 for i in range(8)}
    # the step's row budget caps the drafts
    assert sum(choose_drafts(batch, ratio=0.0, num_rows=8, num_samples=8, max_rows=12).values()) == 4


def test_keep_rate_falls_with_failures_and_recovers_as_evidence_ages():
    state = SequenceDrafts(TokenHistory())
    assert state.keep_rate == 0.5
    for _ in range(10):
        state.observe(num_drafts=2, num_kept=0, num_tested=1)
    low = state.keep_rate
    assert low < 0.12
    for _ in range(200):
        state.skipped()
    assert state.keep_rate > 0.3  # probed again
    assert (state.num_draft_tokens, state.num_accepted_tokens) == (20, 0)


def test_step_cost_fits_rows_and_falls_back_to_its_prior():
    cost = StepCost()
    assert cost.ratio == StepCost.PRIOR_RATIO
    for _ in range(50):
        cost.note(1, 0.010)  # no spread in rows yet: the prior
    assert cost.ratio == StepCost.PRIOR_RATIO
    for rows in (1, 3, 5, 2, 4, 6) * 20:
        cost.note(rows, 0.008 + 0.002 * rows)
    assert cost.ratio == pytest.approx(0.25, rel=0.02)


def test_speculative_config_reads_vllm_json():
    config = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    assert (config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == (5, 4, 2)
    assert SpeculativeConfig.from_json('{"num_speculative_tokens": 3, "prompt_lookup_max": 1}').prompt_lookup_min == 1
    assert SpeculativeConfig.from_json("") is None


@pytest.mark.parametrize("text, message", [
    ('{"method": "eagle", "num_speculative_tokens": 3}', "not supported"),
    ('{"method": "ngram"}', "needs num_speculative_tokens"),
    ('{"num_speculative_tokens": 3, "model": "x"}', "unsupported keys"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ('{"num_speculative_tokens": "3"}', "integer"),
    ("[3]", "JSON object"),
    ("{", "not JSON"),
])
def test_speculative_config_refuses_what_it_cannot_do(text, message):
    with pytest.raises(InvalidRequestError, match=message):
        SpeculativeConfig.from_json(text)


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[length - n:]:
                return tokens[start + n:start + n + k]
    return []


def test_propose_equals_a_brute_force_search_on_random_sequences():
    rng = np.random.default_rng(7)
    for _ in range(3000):
        tokens = rng.integers(0, 3, rng.integers(1, 40)).tolist()  # 3 symbols: many matches
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 7))
        k = int(rng.integers(1, 6))
        assert propose(arr(*tokens), min_n, max_n, k).tolist() == brute_force(tokens, min_n, max_n, k), \
            (tokens, min_n, max_n, k)


def test_the_speculator_checks_drafts_keeps_the_agreeing_ones_and_gives_back_the_rest():
    """The collaborator alone, on a real cache: a plain chunk and a chunk with three drafts
    in one step; the model (logits) agrees with the first draft only."""
    import torch

    from pdserve.engine.config import CacheConfig, ModelConfig
    from pdserve.engine.kv_cache_manager import KVCacheManager
    from pdserve.engine.outputs import delta
    from pdserve.engine.request import Request
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.scheduler import ScheduledChunk
    from pdserve.engine.speculation import NO_SPECULATION, Speculator

    block, vocab = 8, 50
    model = ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=16, intermediate_size=32,
                        num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                        max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)
    kv = KVCacheManager(model, CacheConfig(block_size=block, num_blocks=16), torch.device("cpu"))
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    plain, drafted = (Request(rid, [1, 2, 3, 4, 5], greedy) for rid in ("plain", "drafted"))
    for request in (plain, drafted):
        request.output_token_ids.append(9)
        request.num_computed_tokens = request.num_tokens - 1
        assert kv.prepare_resources(request, 1 + 3)  # positions 5..8: two blocks, as drafts hold
    chunks = [ScheduledChunk(plain, 5, 1), ScheduledChunk(drafted, 5, 1, draft_token_ids=(20, 21, 22))]
    for chunk in chunks:
        chunk.request.num_computed_tokens = chunk.start + chunk.num_new_tokens  # the engine's step did
    logits = torch.zeros(1 + 4, vocab)
    for row, token in enumerate([11, 20, 30, 40, 41]):  # plain's row, then drafted's four rows
        logits[row, token] = 1.0

    def record(items):
        out = []
        for request, token, logprob in items:
            request.output_token_ids.append(token)
            out.append(delta(request, (token,), "", ()))
        return out

    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=3), kv)
    deltas = speculator.sample(chunks, logits, record)
    assert [(d.request_id, d.new_token_ids) for d in deltas] == [("plain", (11,)), ("drafted", (20, 30))]
    assert drafted.num_computed_tokens == 7  # its token and the kept draft
    assert len(kv.blocks_of("drafted")) == 1  # the block past the next token (7) went back
    assert speculator.totals() == (3, 1, 1)
    assert deltas[1].num_draft_tokens == 3 and deltas[1].num_accepted_tokens == 1
    assert [d.new_token_ids for d in NO_SPECULATION.sample(chunks[:1], logits[:1], record)] == [(11,)]
    for request in (plain, drafted):
        kv.free_resources(request.request_id)
    kv.assert_all_free()

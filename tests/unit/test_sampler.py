"""Sampler on hand-made logits: greedy, seeds, top-k / top-p, min_tokens, logprobs; and the
validation of SamplingParams."""
from __future__ import annotations

import pytest
import torch

from pdserve.common.errors import InvalidRequestError
from pdserve.engine.request import Request
from pdserve.engine.sampler import sample
from pdserve.engine.sampling_params import SamplingParams

VOCAB = 50
EOS = 3


def make_request(params: SamplingParams, rid: str = "r") -> Request:
    r = Request(rid, [1, 2], params, eos_token_ids=(EOS,))
    r.generator = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
    return r


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def draw(params: SamplingParams, logits: torch.Tensor, n: int) -> list[int]:
    """n tokens from the same logits row, through one request's generator."""
    req = make_request(params)
    for _ in range(n):
        req.output_token_ids.append(sample(logits.clone(), [req])[0].token_id)
    return req.output_token_ids


def test_greedy_is_argmax_per_row():
    logits = logits_rows(4)
    reqs = [make_request(SamplingParams(temperature=0.0), f"r{i}") for i in range(4)]
    assert [t.token_id for t in sample(logits.clone(), reqs)] == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = logits_rows(1) / 3  # flat enough that draws vary
    a = draw(SamplingParams(temperature=1.0, seed=1234), logits, 30)
    b = draw(SamplingParams(temperature=1.0, seed=1234), logits, 30)
    c = draw(SamplingParams(temperature=1.0, seed=99), logits, 30)
    assert a == b
    assert a != c
    assert len(set(a)) > 3  # really sampling, not argmax


def test_a_seeded_draw_depends_only_on_seed_and_index():
    """A request handed over after its first token (remote prefill) draws what one local run
    would: its fresh generator is reseeded per token, not continued from a stream."""
    logits = logits_rows(1) / 3
    local = draw(SamplingParams(temperature=1.0, seed=77), logits, 12)
    resumed = make_request(SamplingParams(temperature=1.0, seed=77), "resumed")
    resumed.generator = torch.Generator().manual_seed(123)  # whatever state it starts in
    resumed.output_token_ids.append(local[0])  # the first token came from elsewhere
    for _ in range(11):
        resumed.output_token_ids.append(sample(logits.clone(), [resumed])[0].token_id)
    assert resumed.output_token_ids == local


def test_prefill_first_token_keeps_min_tokens():
    from pdserve.prefill.runner import first_token_params

    p = first_token_params(SamplingParams(max_tokens=50, min_tokens=5, seed=3, stop=("x",), temperature=0.7))
    assert (p.max_tokens, p.min_tokens, p.stop, p.seed, p.temperature) == (1, 1, (), 3, 0.7)
    assert first_token_params(SamplingParams(max_tokens=50)).min_tokens == 0


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = logits_rows(1, seed=3) / 3
    best = int(logits.argmax())
    assert set(draw(SamplingParams(temperature=1.0, top_k=1, seed=5), logits, 20)) == {best}
    assert set(draw(SamplingParams(temperature=1.0, top_p=1e-6, seed=5), logits, 20)) == {best}
    assert SamplingParams(top_k=1).is_greedy


def test_top_k_keeps_only_the_k_best():
    logits = logits_rows(1, seed=4) / 3
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    drawn = set(draw(SamplingParams(temperature=2.0, top_k=3, seed=8), logits, 60))
    assert drawn <= allowed and len(drawn) > 1


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.full((1, VOCAB), -20.0)
    logits[0, [10, 11, 12]] = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    drawn = set(draw(SamplingParams(temperature=1.0, top_p=0.7, seed=2), logits, 60))
    assert drawn == {10, 11}  # 0.5 < 0.7, 0.5 + 0.3 reaches it; 12 is dropped


def test_low_temperature_sharpens_towards_greedy():
    logits = logits_rows(1, seed=6)
    best = int(logits.argmax())
    assert set(draw(SamplingParams(temperature=0.01, seed=3), logits, 20)) == {best}


def test_min_tokens_suppresses_eos_and_stop_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 9] = 9.0
    logits[0, 4] = 8.0
    req = make_request(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(9,)))
    assert sample(logits.clone(), [req])[0].token_id == 4
    req.output_token_ids += [4, 4]  # min_tokens reached: EOS is allowed again
    assert sample(logits.clone(), [req])[0].token_id == EOS
    ignoring = make_request(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True))
    assert sample(logits.clone(), [ignoring])[0].token_id == EOS  # EOS is not a stop then


def test_logprobs_chosen_and_top_n():
    logits = logits_rows(3, seed=7)
    expected = torch.log_softmax(logits, -1)
    reqs = [make_request(SamplingParams(temperature=0.0, logprobs=n), f"r{n}") for n in (0, 1, 5)]
    out = sample(logits.clone(), reqs)
    for i, (tok, n) in enumerate(zip(out, (0, 1, 5))):
        lp = tok.logprob
        assert lp.token_id == tok.token_id == int(logits[i].argmax())
        assert lp.logprob == pytest.approx(float(expected[i, tok.token_id]), abs=1e-5)
        assert len(lp.top) == n
        top_ids = torch.topk(expected[i], n).indices.tolist() if n else []
        assert [t for t, _ in lp.top] == top_ids
        for t, v in lp.top:
            assert v == pytest.approx(float(expected[i, t]), abs=1e-5)
    assert sample(logits.clone(), [make_request(SamplingParams(temperature=0.0))])[0].logprob is None


def test_sampled_token_logprob_is_its_own():
    logits = logits_rows(1, seed=9) / 3
    req = make_request(SamplingParams(temperature=1.0, seed=11, logprobs=2))
    tok = sample(logits.clone(), [req])[0]
    assert tok.logprob.token_id == tok.token_id
    assert tok.logprob.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[tok.token_id]),
                                                abs=1e-5)


def test_mixed_batch_keeps_rows_apart():
    logits = logits_rows(3, seed=10)
    reqs = [make_request(SamplingParams(temperature=0.0), "g"),
            make_request(SamplingParams(temperature=1.0, top_k=1, seed=1), "k"),
            make_request(SamplingParams(temperature=0.0, logprobs=2), "l")]
    out = sample(logits.clone(), reqs)
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2, min_tokens=3), "min_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop=("",)), "stop"),
    (dict(seed=2**63), "seed"),  # any int64 is a seed, as the router takes
    (dict(temperature=2.5), "temperature"),  # the router's [0, 2]
])
def test_out_of_range_sampling_values_are_refused(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="\n").stop == ("\n",)

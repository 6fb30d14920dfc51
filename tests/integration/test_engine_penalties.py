"""Penalties and logit_bias on a tiny random model equal transformers' generate with the same
logits processors (greedy, token for token)."""
from __future__ import annotations

import pytest
import torch

from pdserve.common.errors import InvalidRequestError
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

NEW = 12
_g = torch.Generator().manual_seed(5)
PROMPTS = [torch.randint(3, 256, (n,), generator=_g).tolist() for n in (5, 17, 30, 41)]


def make_llm(model_dir):
    return LLM(str(model_dir), num_blocks=64, block_size=16)


def token_ids(completions) -> list[list[int]]:
    return [list(c.token_ids) for c in completions]


class OpenAIPenalties:
    """OpenAI's documented presence/frequency rule as a transformers logits processor:
    logit[j] -= frequency * count[j] + presence * (count[j] > 0), counts over generated tokens."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        generated = input_ids[0, self.prompt_len:]
        counts = torch.bincount(generated, minlength=scores.shape[-1])[: scores.shape[-1]].float()
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    pass


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    import transformers

    model_dir = tiny_model_factory("llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return make_llm(model_dir), model


def _reference(model, prompt, processors=(), **kwargs) -> list[int]:
    import transformers

    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         logits_processor=transformers.LogitsProcessorList(list(processors)), **kwargs)
    return out[0, len(prompt):].tolist()


def _ours(llm, **params) -> list[list[int]]:
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, **params)
    outs = token_ids(llm.generate(PROMPTS[:4], sp))
    llm.engine.assert_no_leaks()
    return outs


def test_repetition_penalty_equals_transformers(tiny):
    llm, model = tiny
    plain = _ours(llm)
    ours = _ours(llm, repetition_penalty=1.8)
    assert ours == [_reference(model, p, repetition_penalty=1.8) for p in PROMPTS[:4]]
    assert ours != plain  # the penalty changed something


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 1.2), (0.7, 0.9), (-1.0, 0.0)])
def test_presence_and_frequency_penalties_equal_the_reference_processor(tiny, presence, frequency):
    llm, model = tiny
    ours = _ours(llm, presence_penalty=presence, frequency_penalty=frequency)
    assert ours == [_reference(model, p, [OpenAIPenalties(len(p), presence, frequency)]) for p in PROMPTS[:4]]


def test_logit_bias_equals_transformers_sequence_bias(tiny):
    import transformers

    llm, model = tiny
    bias = ((17, 8.0), (40, 6.5), (5, -100.0))
    ours = _ours(llm, logit_bias=bias)
    processor = transformers.SequenceBiasLogitsProcessor({(t,): b for t, b in bias})
    assert ours == [_reference(model, p, [processor]) for p in PROMPTS[:4]]
    assert any(t in (17, 40) for row in ours for t in row)


@pytest.mark.parametrize("kwargs", [dict(presence_penalty=2.5), dict(frequency_penalty=-3),
                                    dict(repetition_penalty=0.0), dict(logit_bias=((1, 101.0),))])
def test_out_of_range_penalties_are_refused(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_logit_bias_outside_the_vocab_is_refused(tiny):
    llm, _ = tiny
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.generate([PROMPTS[0]], SamplingParams(logit_bias=((10**6, 1.0),)))
    llm.engine.assert_no_leaks()

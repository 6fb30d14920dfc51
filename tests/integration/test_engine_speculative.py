"""Speculative decoding in the engine: scripted drafts on a tiny model against the output
without speculation (kept drafts counted, rejected drafts' blocks back at once, under every
capacity policy), seeded sampling unchanged, and SmolLM2 copying a text: the same greedy
tokens with fewer steps, grammar-constrained requests never emitting a refused draft."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest

from pdserve.common.util import cdiv
from pdserve.engine import speculation
from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.constraints import Constraint
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

BLOCK = 16
K = 4
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * n) % 250 + 3 for i in range(n)] for n in (5, 15, 16, 31, 40)]


class FreeRows:
    """A step cost where rows are free: every proposed draft runs."""

    ratio = 0.0

    def note(self, rows: int, seconds: float) -> None:
        pass


@dataclass
class Script:
    """Drafts from the known continuation of each prompt, wrong at a place that moves
    with the output's length (a draft list fully right once in K + 1 steps)."""

    references: dict[tuple[int, ...], list[int]]
    num_offered: int = 0
    expected_kept: int = 0

    def propose(self, tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
        seq = tokens.tolist()
        for prompt, reference in self.references.items():
            if tuple(seq[:len(prompt)]) == prompt:
                done = len(seq) - len(prompt)
                drafts = reference[done:done + k]
                wrong = done % (K + 1)
                if wrong < len(drafts):
                    drafts = drafts[:wrong] + [(drafts[wrong] + 1) % 250 + 3] + drafts[wrong + 1:]
                return np.array(drafts, dtype=np.int32)
        raise AssertionError("an unknown sequence")


def speculative_llm(model_dir, **overrides) -> LLM:
    llm = LLM(str(model_dir), block_size=BLOCK, speculative=SpeculativeConfig(num_speculative_tokens=K),
              **{"num_blocks": 96, **overrides})
    llm.engine.speculator.cost = FreeRows()
    return llm


def blocks_held_match_kept_tokens(llm: LLM) -> None:
    """Every running request holds blocks for its computed tokens and the next one, no more."""
    for request in llm.engine.scheduler.running:
        held = len(llm.engine.kv.blocks_of(request.request_id))
        assert held <= cdiv(request.num_computed_tokens + 1, BLOCK), (request.request_id, held)


@pytest.mark.parametrize("policy, num_blocks", [("GUARANTEED_NO_EVICT", 96), ("MAX_UTILIZATION", 14),
                                                ("STATIC_BATCH", 96)])
def test_scripted_drafts_keep_the_output_and_give_back_rejected_blocks(
        tiny_model_factory, monkeypatch, policy, num_blocks):
    model = tiny_model_factory("llama")
    plain = LLM(str(model), block_size=BLOCK, num_blocks=96)
    references = {tuple(p): list(c.token_ids) for p, c in zip(PROMPTS, plain.generate(PROMPTS, GREEDY))}
    script = Script(references)
    monkeypatch.setattr(speculation, "propose", script.propose)
    llm = speculative_llm(model, capacity_policy=policy, num_blocks=num_blocks)
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while llm.engine.has_unfinished():
        for out in llm.step():
            tokens[out.request_id] += out.new_token_ids
        blocks_held_match_kept_tokens(llm)
    for rid, prompt in zip(ids, PROMPTS):
        assert tokens[rid] == references[tuple(prompt)]
    stats = llm.engine.stats()
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert stats.num_steps < plain.engine.stats().num_steps - 1  # fewer steps for the same tokens (and its prefill)
    llm.engine.assert_no_leaks()


def test_kept_drafts_follow_the_script(tiny_model_factory, monkeypatch):
    """One sequence: the draft wrong at place `done % 5` keeps exactly the drafts before it."""
    model = tiny_model_factory("llama")
    prompt = PROMPTS[2]
    reference = list(LLM(str(model), block_size=BLOCK, num_blocks=96).generate([prompt], GREEDY)[0].token_ids)
    monkeypatch.setattr(speculation, "propose", Script({tuple(prompt): reference}).propose)
    llm = speculative_llm(model)
    rid = llm.add_request(prompt, GREEDY)
    outputs = []
    while llm.engine.has_unfinished():
        outputs += [o for o in llm.step() if o.request_id == rid and o.new_token_ids]
    done = 1  # the prompt's step gives the first token; every later delta is one verification
    for out in outputs[1:]:
        left = len(reference) - done - 1
        drafts = min(K, left)
        kept = min(done % (K + 1), drafts)
        assert len(out.new_token_ids) == min(kept + 1, len(reference) - done), (done, out.new_token_ids)
        done += len(out.new_token_ids)
    assert [t for o in outputs for t in o.new_token_ids] == reference
    llm.engine.assert_no_leaks()


def test_seeded_sampling_is_the_same_with_drafts(tiny_model_factory, monkeypatch):
    model = tiny_model_factory("llama")
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True,
                            frequency_penalty=0.3, logprobs=2)
    plain = LLM(str(model), block_size=BLOCK, num_blocks=96).generate(PROMPTS, seeded)
    script = Script({tuple(p): list(c.token_ids) for p, c in zip(PROMPTS, plain)})
    monkeypatch.setattr(speculation, "propose", script.propose)
    llm = speculative_llm(model)
    again = llm.generate(PROMPTS, seeded)
    assert [c.token_ids for c in again] == [c.token_ids for c in plain]
    assert [[round(lp.logprob, 4) for lp in c.logprobs] for c in again] == \
        [[round(lp.logprob, 4) for lp in c.logprobs] for c in plain]
    assert llm.engine.stats().num_accepted_tokens > 0
    llm.engine.assert_no_leaks()


TEXT = ("Chen bought a silver watch in Osaka on day 9. Bruno bought a wooden chair in Riga on day 16. "
        "Goran bought an old violin in Quito on day 20. Alice bought a wooden chair in Lima on day 14.")
COPY = f"<|im_start|>user\nRepeat the following text exactly, word for word:\n\n{TEXT}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm2(one_torch_thread):
    plain = LLM("default", num_blocks=64)
    spec = LLM("default", num_blocks=64, speculative=SpeculativeConfig(num_speculative_tokens=5))
    return plain, spec


def test_smollm2_copies_a_text_in_fewer_steps_with_the_same_tokens(smollm2):
    plain, spec = smollm2
    params = SamplingParams(max_tokens=60, temperature=0.0)
    before = spec.engine.stats()
    (a,), (b,) = plain.generate([COPY], params), spec.generate([COPY], params)
    after = spec.engine.stats()
    assert b.token_ids == a.token_ids and b.text == a.text
    kept = after.num_accepted_tokens - before.num_accepted_tokens
    assert kept >= len(b.token_ids) // 3, (kept, len(b.token_ids))
    plain.engine.assert_no_leaks()
    spec.engine.assert_no_leaks()


def test_grammar_constrained_requests_never_emit_a_refused_draft(smollm2):
    plain, spec = smollm2
    schema = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 200}},
              "required": ["text"], "additionalProperties": False}
    prompt = (f"<|im_start|>user\nReturn this text as JSON with one key, text:\n\n{TEXT}<|im_end|>\n"
              "<|im_start|>assistant\n")
    params = SamplingParams(max_tokens=80, temperature=0.0, constraint=Constraint("json_schema", json.dumps(schema)))
    (a,), (b,) = plain.generate([prompt], params), spec.generate([prompt], params)
    assert b.token_ids == a.token_ids
    if b.finish_reason == "stop":
        assert set(json.loads(b.text)) == {"text"}
    # a draft the grammar refuses is cut before the step: the JSON opening is not in the text
    request = spec.engine.add_request(prompt, params)
    assert request.grammar.num_valid(spec.tokenizer.encode("Chen bought", add_special_tokens=False)) == 0
    assert request.grammar.num_valid(spec.tokenizer.encode('{"text', add_special_tokens=False)) >= 1
    spec.engine.abort(request.request_id)
    spec.step()
    spec.engine.assert_no_leaks()

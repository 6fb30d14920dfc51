"""Generated blocks are cached like prompt blocks: the next turn of a chat (history + the
last answer) finds its whole history in the prefix cache, keyed as the router keys it."""
from __future__ import annotations

import torch

from pdserve.common.block_hash import prompt_blocks
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

BLOCK = 16


def _turns(llm, first, n_turns=3, answer_tokens=21, user_tokens=7):
    g = torch.Generator().manual_seed(11)
    prompt, seen = list(first), []
    params = SamplingParams(max_tokens=answer_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(n_turns):
        done = llm.generate(prompt, params)[0]
        seen.append((len(prompt), done))
        prompt = prompt + list(done.token_ids) + torch.randint(3, 250, (user_tokens,), generator=g).tolist()
    return seen


def test_next_turn_finds_prompt_and_answer(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    llm = LLM(str(model_dir), num_blocks=64, block_size=BLOCK)
    plain = LLM(str(model_dir), num_blocks=64, block_size=BLOCK, enable_prefix_caching=False)
    first = torch.randint(3, 250, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    turns = _turns(llm, first)
    for (prev_len, prev), (_, now) in zip(turns, turns[1:]):
        history = prev_len + len(prev.token_ids)
        # all of the previous prompt and answer but the block still partial when it ended
        # (its last token's KV is never computed: it is the next prompt's)
        assert now.num_cached_tokens >= (history - 1) // BLOCK * BLOCK
        assert now.num_cached_tokens >= history - BLOCK
    for (n, cached), (_, base) in zip(turns, _turns(plain, first)):
        assert cached.token_ids == base.token_ids  # same greedy text with and without the cache
    llm.engine.assert_no_leaks()


def test_generated_block_keys_chain_like_a_prompt(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    llm = LLM(str(model_dir), num_blocks=64, block_size=BLOCK)
    engine = llm.engine
    prompt = torch.randint(3, 250, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    rid = "chain"
    engine.add_request(prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), request_id=rid)
    request = engine.scheduler.find(rid)
    while engine.has_unfinished():
        engine.step()
    whole = prompt + request.output_token_ids
    expected = prompt_blocks(whole[:len(whole) - 1], BLOCK, engine.compat_hash, engine.config.block_hash_key)
    assert request.block_hashes == expected.hashes and len(expected.hashes) == 3
    assert request.block_digests == expected.digests
    cached = set(engine.kv.pool.cached_hashes())
    assert set(expected.hashes) <= cached
    engine.assert_no_leaks()

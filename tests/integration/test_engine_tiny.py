"""The engine end to end on tiny random-weight models, against transformers `generate`.

Greedy token ids must equal transformers' (fp32, CPU) for 8 prompts of different lengths run
together, whatever path the engine takes: chunked or not, prefix hits, preemption under
MAX_UTILIZATION, EQUAL_PROGRESS, STATIC_BATCH, an attention window (against Mistral's
sliding window). Every test ends with the leak check: every block back in the pool.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.block_pool import NULL_BLOCK_ID
from pdserve.common.errors import (CapacityError, InvalidRequestError, ModelLoadError,
                                   PromptTooLongError)
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

BLOCK = 16
PROMPT_LENS = (3, 9, 16, 17, 25, 33, 40, 58)  # under, at and across block boundaries
NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def random_prompts(lens=PROMPT_LENS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lens]


PROMPTS = random_prompts()


class Reference:
    """transformers' greedy continuation of each prompt, one prompt at a time (no padding),
    EOS disabled so every continuation has the asked length. Results are memoised."""

    def __init__(self, model_dir: Path, **load_kwargs) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, **load_kwargs)
        self.model.generation_config.eos_token_id = None
        self._memo: dict[tuple, list[int]] = {}

    def greedy(self, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
        key = (tuple(prompt), n)
        if key not in self._memo:
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            self._memo[key] = out[0, len(prompt):].tolist()
        return self._memo[key]

    def logprobs(self, prompt: list[int], n: int) -> torch.Tensor:
        """[n, vocab] log-softmax of the logits at each greedy step."""
        out = self.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  return_dict_in_generate=True, output_logits=True)
        return torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """Tiny matmuls run fastest on one thread (and a shared machine punishes spinning ones)."""


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llama_ref(llama_dir) -> Reference:
    return Reference(llama_dir)


def make_llm(model_dir: Path, **overrides) -> LLM:
    overrides.setdefault("num_blocks", 64)
    overrides.setdefault("block_size", BLOCK)
    return LLM(str(model_dir), **overrides)


def token_ids(completions) -> list[list[int]]:
    return [list(c.token_ids) for c in completions]


def expected(ref: Reference, prompts=PROMPTS, n: int = NEW_TOKENS) -> list[list[int]]:
    return [ref.greedy(p, n) for p in prompts]


# -- greedy equality -----------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_batch_equals_transformers(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    llm = make_llm(model_dir, max_num_tokens=64)  # 201 prompt tokens: chunked over 4 steps
    outs = llm.generate(PROMPTS, GREEDY)
    assert token_ids(outs) == expected(Reference(model_dir))
    assert all(o.finish_reason == "length" for o in outs)
    stats = llm.engine.stats()
    assert stats.num_prompt_tokens_computed == sum(PROMPT_LENS)
    assert stats.num_generation_tokens == NEW_TOKENS * len(PROMPTS)
    llm.engine.assert_no_leaks()


def test_chunked_prefill_equals_unchunked(llama_dir, llama_ref):
    want = expected(llama_ref)
    chunked = make_llm(llama_dir, max_num_tokens=16)  # the 58-token prompt takes 4+ steps
    unchunked = make_llm(llama_dir, enable_chunked_prefill=False, max_num_tokens=2048)
    assert token_ids(chunked.generate(PROMPTS, GREEDY)) == want
    assert token_ids(unchunked.generate(PROMPTS, GREEDY)) == want
    chunked.engine.assert_no_leaks()
    unchunked.engine.assert_no_leaks()


def test_equal_progress_equals_first_come_first_served(llama_dir, llama_ref):
    fcfs = make_llm(llama_dir, max_num_tokens=32, chunking_policy="FIRST_COME_FIRST_SERVED")
    equal = make_llm(llama_dir, max_num_tokens=32, chunking_policy="EQUAL_PROGRESS")
    shortest = make_llm(llama_dir, max_num_tokens=32, chunking_policy="SHORTEST_FIRST")
    a, b = token_ids(fcfs.generate(PROMPTS, GREEDY)), token_ids(equal.generate(PROMPTS, GREEDY))
    assert a == b == token_ids(shortest.generate(PROMPTS, GREEDY)) == expected(llama_ref)
    for llm in (fcfs, equal, shortest):
        llm.engine.assert_no_leaks()


def test_static_batch(llama_dir, llama_ref):
    llm = make_llm(llama_dir, capacity_policy="STATIC_BATCH", max_batch_size=3, max_num_tokens=64)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected(llama_ref)
    assert llm.engine.stats().num_preemptions == 0
    llm.engine.assert_no_leaks()


# -- capacity policies under a tiny cache -------------------------------------------------

TIGHT = dict(num_blocks=8, max_num_tokens=64)  # 128 token slots; the batch wants ~24 blocks


def test_max_utilization_preempts_and_still_matches(llama_dir, llama_ref):
    long_params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = make_llm(llama_dir, capacity_policy="MAX_UTILIZATION", **TIGHT)
    outs = llm.generate(PROMPTS, long_params)
    assert llm.engine.stats().num_preemptions > 0
    assert token_ids(outs) == expected(llama_ref, n=16)
    llm.engine.assert_no_leaks()


def test_guaranteed_no_evict_never_preempts(llama_dir, llama_ref):
    long_params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = make_llm(llama_dir, capacity_policy="GUARANTEED_NO_EVICT", **TIGHT)
    max_running = 0
    for p in PROMPTS:
        llm.add_request(p, long_params)
    tokens: dict[str, list[int]] = {}
    while llm.engine.has_unfinished():
        for out in llm.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        max_running = max(max_running, llm.engine.stats().num_running)
    assert llm.engine.stats().num_preemptions == 0
    assert 1 < max_running < len(PROMPTS)  # the cache, not the batch size, held requests back
    assert [tokens[f"offline-{i}"] for i in range(len(PROMPTS))] == expected(llama_ref, n=16)
    llm.engine.assert_no_leaks()


# -- prefix caching -----------------------------------------------------------------------

def test_shared_prefix_computes_only_new_blocks(llama_dir, llama_ref):
    llm = make_llm(llama_dir)
    engine = llm.engine
    base = random_prompts([40], seed=5)[0]
    (first,) = llm.generate([base], GREEDY)
    assert first.num_cached_tokens == 0 and first.num_computed_prompt_tokens == 40

    extended = base[:32] + random_prompts([10], seed=6)[0]  # shares 2 full blocks
    before = engine.stats().num_prompt_tokens_computed
    (second,) = llm.generate([extended], GREEDY)
    assert second.num_cached_tokens == 32
    assert second.num_computed_prompt_tokens == 10
    assert engine.stats().num_prompt_tokens_computed - before == 10
    assert list(second.token_ids) == llama_ref.greedy(extended)

    before = engine.stats().num_prompt_tokens_computed
    (again,) = llm.generate([base], GREEDY)  # the same prompt: its 2 full blocks are cached
    assert again.num_cached_tokens == 32 and again.num_computed_prompt_tokens == 8
    assert engine.stats().num_prompt_tokens_computed - before == 8
    assert again.token_ids == first.token_ids == tuple(llama_ref.greedy(base))
    engine.assert_no_leaks()


def test_prefix_caching_off_recomputes(llama_dir, llama_ref):
    llm = make_llm(llama_dir, enable_prefix_caching=False)
    base = random_prompts([40], seed=5)[0]
    llm.generate([base], GREEDY)
    (again,) = llm.generate([base], GREEDY)
    assert again.num_cached_tokens == 0 and again.num_computed_prompt_tokens == 40
    assert list(again.token_ids) == llama_ref.greedy(base)
    llm.engine.assert_no_leaks()


def test_requests_sharing_a_prefix_in_one_batch(llama_dir, llama_ref):
    llm = make_llm(llama_dir, max_num_tokens=64)
    stem = random_prompts([48], seed=7)[0]
    prompts = [stem + tail for tail in random_prompts((1, 5, 17, 30), seed=8)]
    outs = llm.generate(prompts, GREEDY)
    assert token_ids(outs) == expected(llama_ref, prompts)
    llm.engine.assert_no_leaks()


# -- attention window (against Mistral's sliding window) ----------------------------------

WINDOW = 20


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory) -> Path:
    import transformers

    config = transformers.MistralConfig(sliding_window=WINDOW, **TINY)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp("models") / "tiny-mistral"
    model.save_pretrained(path, safe_serialization=True)
    return path


def test_attention_window_matches_mistral_and_frees_old_blocks(mistral_dir):
    ref = Reference(mistral_dir, attn_implementation="eager")
    long_prompt = PROMPTS[-1]  # 58 tokens, well past the window
    n = 12
    # the reference really applies the window: without it the continuation differs
    ref.model.config.sliding_window = None
    unwindowed = ref.model.generate(torch.tensor([long_prompt]), max_new_tokens=n, do_sample=False,
                                    attention_mask=torch.ones(1, len(long_prompt), dtype=torch.long))
    ref.model.config.sliding_window = WINDOW
    assert unwindowed[0, len(long_prompt):].tolist() != ref.greedy(long_prompt, n)

    # the window comes from the model's config; an explicit attention_window may only narrow it
    assert make_llm(mistral_dir, num_blocks=4).engine.kv.config.attention_window == WINDOW
    llm = make_llm(mistral_dir, attention_window=WINDOW, max_num_tokens=16)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    assert token_ids(outs) == [ref.greedy(p, n) for p in PROMPTS]
    llm.engine.assert_no_leaks()

    # step one long request: blocks behind the window go back to the pool as it advances
    kv = llm.engine.kv
    cap = -(-WINDOW // BLOCK) + 1
    rid = llm.add_request(long_prompt, params)
    seen_dropped = False
    while llm.engine.has_unfinished():
        llm.step()
        table = kv.blocks_of(rid)
        live = [b for b in table if b != NULL_BLOCK_ID]
        if table and llm.engine.scheduler.running:
            req = llm.engine.scheduler.running[0]
            # what the window still needs: the blocks of positions >= computed - W + 1
            first_live = max(0, req.num_computed_tokens - WINDOW + 1) // BLOCK
            assert table[:first_live] == [NULL_BLOCK_ID] * first_live
            assert len(live) <= cap + 1  # a prefill chunk may span one block more
            seen_dropped |= first_live > 0
            assert kv.get_num_free_blocks() == kv.get_max_resource_count() - len(live)
    assert seen_dropped
    llm.engine.assert_no_leaks()


# -- aborts ---------------------------------------------------------------------------------

def test_abort_while_waiting_mid_prefill_and_mid_decode(llama_dir, llama_ref):
    llm = make_llm(llama_dir, max_num_tokens=16, max_batch_size=2)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prefilling = llm.add_request(PROMPTS[-1], params)  # 58 tokens: 4 steps of prefill
    decoding = llm.add_request(PROMPTS[0], params)
    waiting = llm.add_request(PROMPTS[1], params)  # the batch holds 2: it waits
    survivor = llm.add_request(PROMPTS[2], params)
    llm.step()
    assert llm.engine.kv.blocks_of(prefilling) and not llm.engine.kv.blocks_of(waiting)

    assert llm.abort(waiting)
    assert not llm.abort(waiting)  # already ended
    assert not llm.abort("no-such-request")
    assert llm.abort(prefilling)
    outputs = {}
    for _ in range(3):
        for out in llm.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert 0 < len(sum((o.new_token_ids for o in outputs[decoding]), ())) < 12
    assert llm.abort(decoding)
    rest = []
    while llm.engine.has_unfinished():
        rest += llm.step()
    ends = {o.request_id: o for o in sum(outputs.values(), []) + rest if o.finished}
    for rid in (waiting, prefilling, decoding):
        assert ends[rid].finish_reason == "abort"
    assert ends[survivor].finish_reason == "length"
    survivor_tokens = [t for o in outputs.get(survivor, []) + rest if o.request_id == survivor
                       for t in o.new_token_ids]
    assert survivor_tokens == llama_ref.greedy(PROMPTS[2], 12)
    llm.engine.assert_no_leaks()


def test_abort_from_a_stream(llama_dir):
    llm = make_llm(llama_dir)
    stream = llm.generate_stream(PROMPTS[3], SamplingParams(max_tokens=20, temperature=0.0),
                                 request_id="streamed")
    first = next(stream)
    assert first.new_token_ids and not first.finished
    assert llm.abort("streamed")
    last = list(stream)[-1]
    assert last.finished and last.finish_reason == "abort"
    llm.engine.assert_no_leaks()


# -- sampling through the engine -------------------------------------------------------------

def test_stream_deltas_equal_generate(llama_dir, llama_ref):
    llm = make_llm(llama_dir)
    deltas = list(llm.generate_stream(PROMPTS[4], GREEDY))
    assert [t for d in deltas for t in d.new_token_ids] == llama_ref.greedy(PROMPTS[4])
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    llm.engine.assert_no_leaks()


def test_seeded_sampling_is_reproducible_in_a_batch(llama_dir):
    llm = make_llm(llama_dir)

    def run(seeds):
        params = [SamplingParams(max_tokens=10, temperature=1.5, seed=s, ignore_eos=True) for s in seeds]
        return token_ids(llm.generate(PROMPTS[:len(seeds)], params))

    first, again = run([1, 2, 3]), run([1, 2, 3])
    assert first == again
    other = run([7, 8, 9])
    assert other != first
    llm.engine.assert_no_leaks()


def test_logprobs_match_transformers(llama_dir, llama_ref):
    llm = make_llm(llama_dir)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3)
    (out,) = llm.generate([PROMPTS[5]], params)
    ref = llama_ref.logprobs(PROMPTS[5], 5)
    assert len(out.logprobs) == 5
    for step, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[step] == int(ref[step].argmax())
        assert lp.logprob == pytest.approx(float(ref[step, lp.token_id]), abs=1e-4)
        want_ids = torch.topk(ref[step], 3).indices.tolist()
        assert [t for t, _ in lp.top] == want_ids
        for t, v in lp.top:
            assert v == pytest.approx(float(ref[step, t]), abs=1e-4)
    llm.engine.assert_no_leaks()


def test_prompt_logprobs_match_transformers_chunked_and_past_the_prefix_cache(llama_dir, llama_ref):
    """Each prompt token's logprob (and top 2) equals transformers' forward over the prompt,
    whether the prompt runs in chunks and even when its blocks sit in the prefix cache (a
    prompt whose logprobs are wanted is computed whole)."""
    prompt = PROMPTS[7]  # 58 tokens: 4 chunks of 16 below
    with torch.no_grad():
        logits = llama_ref.model(torch.tensor([prompt])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    llm = make_llm(llama_dir, max_num_tokens=16)
    llm.generate([prompt], GREEDY)  # its full blocks are now cached
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    (out,) = llm.generate([prompt], params)
    assert out.num_cached_tokens == 0 and out.num_computed_prompt_tokens == len(prompt)
    assert [e.token_id for e in out.prompt_logprobs] == prompt[1:]
    for pos, entry in enumerate(out.prompt_logprobs):
        assert entry.logprob == pytest.approx(float(ref[pos, prompt[pos + 1]]), abs=1e-4)
        assert [t for t, _ in entry.top] == torch.topk(ref[pos], 2).indices.tolist()
    assert list(out.token_ids) == llama_ref.greedy(prompt, 2)
    (plain,) = llm.generate([prompt], GREEDY)  # without them the cache serves it again
    assert plain.prompt_logprobs is None and plain.num_cached_tokens == 48
    llm.engine.assert_no_leaks()


def test_stop_token_ids_and_min_tokens(llama_dir, llama_ref):
    llm = make_llm(llama_dir)
    prompt = PROMPTS[6]
    want = llama_ref.greedy(prompt)
    stop_at = next(i for i in range(1, len(want)) if want[i] not in want[:i])
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                   stop_token_ids=(want[stop_at],)))
    assert list(out.token_ids) == want[:stop_at + 1]
    assert out.finish_reason == "stop" and out.stop_reason == want[stop_at]

    first = want[0]
    (held,) = llm.generate([prompt], SamplingParams(max_tokens=6, min_tokens=4, temperature=0.0,
                                                    stop_token_ids=(first,)))
    assert held.token_ids[0] != first  # suppressed until min_tokens
    assert len(held.token_ids) >= 4
    llm.engine.assert_no_leaks()


# -- bad input ----------------------------------------------------------------------------

def test_bad_requests_raise_typed_errors_and_leave_the_engine_healthy(llama_dir, llama_ref):
    llm = make_llm(llama_dir, max_model_len=64, num_blocks=3)
    cases = [
        ([], GREEDY, InvalidRequestError, "empty"),
        ([5] * 64, GREEDY, PromptTooLongError, "context"),
        ([5] * 60, SamplingParams(max_tokens=10), PromptTooLongError, "max_tokens"),
        ([5, 256], GREEDY, InvalidRequestError, r"\[0, 256\)"),
        ([5, -1], GREEDY, InvalidRequestError, r"\[0, 256\)"),
        ("text", GREEDY, InvalidRequestError, "tokenizer"),
        ([5] * 40, SamplingParams(max_tokens=14), CapacityError, "KV blocks"),  # 4 blocks > 3
    ]
    for prompt, params, error, match in cases:
        with pytest.raises(error, match=match):
            llm.generate([prompt], params)
    llm.add_request(PROMPTS[0], GREEDY, request_id="dup")
    with pytest.raises(InvalidRequestError, match="already in use"):
        llm.add_request(PROMPTS[1], GREEDY, request_id="dup")
    llm.abort("dup")
    assert token_ids(llm.generate(PROMPTS[:2], GREEDY)) == expected(llama_ref, PROMPTS[:2])
    llm.engine.assert_no_leaks()


def test_unknown_model_path_and_corrupt_gguf(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        LLM(str(tmp_path / "no-such-model"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(ModelLoadError, match="GGUF"):
        LLM(str(bad), use_build_cache=False)
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("this is not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        LLM(str(not_gguf))
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(empty_dir))


# -- the offline benchmark runs end to end (on the tiny model: a smoke test, not a timing) ----

def test_offline_benchmark_smoke(llama_dir, tmp_path, capsys):
    import json

    from pdserve.bench import offline

    out = tmp_path / "bench.json"
    rc = offline.main(["--model", str(llama_dir), "--threads", "1", "--concurrency", "2", "3",
                       "--new-tokens", "4", "--prompt-len", "20", "--prefill-len", "64",
                       "--decode-batches", "1", "3", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "batch 3 x ~20 prompt, 4 new" in printed and "prefill, 64-token prompt" in printed
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 + 1 + 1 + 2  # two batch rows, TTFT, prefill, the decode steps
    for row in rows[:4]:
        assert row["ours"] > 0 and row["theirs"] > 0 and row["ratio"] > 0
        assert row["agreement"] in (None, 1.0)  # greedy tokens equal transformers'
    assert [r["name"] for r in rows[4:]] == ["decode step, batch 1", "decode step, batch 3"]
    assert all(r["ours"] > 0 for r in rows[4:])
    assert "operator calls" in printed and "in GEMM" in printed and "step/bound" in printed
    assert torch.get_num_threads() == 1


def _run_engine(llm: LLM, prompt, params: SamplingParams, resumed=()) -> tuple[list[int], object]:
    """Drive the engine directly (add_request with `resumed`) to the request's end."""
    llm.engine.add_request(prompt, params, request_id="resumed", resumed=resumed)
    tokens, last = [], None
    while llm.engine.has_unfinished():
        outputs, _ = llm.engine.step()
        for out in outputs:
            tokens += out.new_token_ids
            last = out if out.finished else last
    return tokens, last


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=1.3, seed=11, ignore_eos=True, frequency_penalty=0.7),
], ids=["greedy", "seeded-with-penalty"])
def test_resumed_request_continues_exactly_where_it_stopped(llama_dir, params):
    """A request migrated after k tokens (its resumed tokens) generates exactly the rest of the
    uninterrupted run: the seeded draw's index, the penalties and max_tokens count the resumed
    tokens as output; only new tokens are returned; usage counts all of them."""
    llm = make_llm(llama_dir)
    full, _ = _run_engine(llm, PROMPTS[5], params)
    for k in (1, 6, 13):
        rest, last = _run_engine(llm, PROMPTS[5], params, resumed=full[:k])
        assert rest == full[k:], k
        assert last.num_output_tokens == len(full) and last.num_prompt_tokens == len(PROMPTS[5])
    with pytest.raises(InvalidRequestError, match="resumed"):
        llm.engine.add_request(PROMPTS[5], params, request_id="over", resumed=full)
    llm.engine.assert_no_leaks()


# -- int8 (opt-in) --------------------------------------------------------------------------

def test_int8_linears_stay_close_to_fp32_and_change_the_compatibility_hash(llama_dir, llama_ref):
    """`quantization="int8"`: every linear but down_proj runs the dynamic int8 GEMM. Its
    logits stay close to fp32's (tiny random model), generation runs and frees everything,
    and the KV compatibility hash differs, so a fp32 peer refuses its blocks (and the
    router refuses a mismatched worker of the same model)."""
    import torch

    from pdserve.common.errors import InvalidRequestError
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.models.linear import Linear

    torch.manual_seed(0)
    w, x = torch.randn(96, 64) * 0.1, torch.randn(8, 64)
    exact, approx = torch.nn.functional.linear(x, w), Linear(w, quantize="int8")(x)
    assert (approx - exact).abs().max() <= 0.03 * exact.abs().max()

    fp32 = make_llm(llama_dir)
    int8 = make_llm(llama_dir, quantization="int8")
    layer = int8.engine.model.layers[0]
    assert layer.qkv.weight is None and layer.down.weight is None  # packed copies replace them
    assert layer.qkv._int8 is not None and layer.down._int8 is None
    outs = int8.generate(PROMPTS, GREEDY)
    assert all(len(o.token_ids) == NEW_TOKENS for o in outs)
    agree = sum(a == b for a, b in zip(token_ids(outs), expected(llama_ref)))
    assert agree >= len(PROMPTS) // 2, agree  # close numerics: most greedy answers unchanged here
    assert int8.engine.compat_hash != fp32.engine.compat_hash
    int8.engine.assert_no_leaks()
    with pytest.raises(InvalidRequestError, match="CPU with float32"):
        EngineConfig(quantization="int8", dtype="bfloat16")


def test_stats_report_queued_prompt_tokens_and_the_prefill_rate(llama_dir):
    """What the router's TTFT prediction reads: prompt tokens not computed yet (waiting and
    running, chunked prefills included) and a prefill rate once enough prompt tokens have run
    (a few time a step's fixed cost, not the rate)."""
    from pdserve.engine.outputs import PrefillRate

    llm = make_llm(llama_dir, max_num_tokens=16)
    engine = llm.engine
    assert engine.stats().num_queued_prompt_tokens == 0 and engine.stats().prefill_tokens_per_s == 0
    params = SamplingParams(max_tokens=2, temperature=0.0)
    llm.add_request(list(range(3, 43)), params)  # 40 tokens: three chunks of 16
    llm.add_request(list(range(50, 90)), params)
    assert engine.stats().num_queued_prompt_tokens == 80
    engine.step()
    assert engine.stats().num_queued_prompt_tokens == 64
    assert engine.stats().prefill_tokens_per_s == 0  # 16 tokens: not a rate yet
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().num_queued_prompt_tokens == 0
    assert engine.stats().prefill_tokens_per_s > 0  # 80 tokens
    engine.assert_no_leaks()
    # a decode's request whose prompt a prefill service computes is not this engine's work,
    # waiting for admission or for its KV (counted, a chat's turns looked 6 s away locally)
    engine.add_request(list(range(3, 43)), params, request_id="remote", remote_prefill=True)
    assert engine.stats().num_queued_prompt_tokens == 0
    engine.step()
    assert engine.stats().num_queued_prompt_tokens == 0
    assert engine.abort("remote")
    engine.assert_no_leaks()

    rate = PrefillRate(half_life_tokens=100, min_tokens=64)
    rate.note(0, 1.0)
    rate.note(4, 0.04)  # a warm-up prompt: mostly the step's fixed cost
    assert rate.tokens_per_s == 0
    rate.note(96, 0.96)
    assert rate.tokens_per_s == 100
    rate.note(100, 0.25)  # one half-life of tokens at 400/s: halfway there
    assert rate.tokens_per_s == pytest.approx(250)


def test_offline_dtype_sets_the_model_and_its_cache(llama_dir):
    """`LLM(dtype=...)` is the model's dtype and its KV cache's, as the workers' --dtype is
    (it once reached only the cache: a bfloat16 cache under a float32 model, refused at the
    first KV write)."""
    llm = make_llm(llama_dir, dtype="bfloat16")
    assert llm.engine.model.embed.dtype == torch.bfloat16
    assert llm.engine.kv.kv_caches[0].dtype == torch.bfloat16
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    llm.engine.assert_no_leaks()

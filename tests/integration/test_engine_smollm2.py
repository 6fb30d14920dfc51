"""The engine on the default model (SmolLM2-135M-Instruct, from its GGUF via the build cache),
with chat-templated prompts, against transformers `generate` on the same weights.

One engine and one transformers model serve the whole module (loading takes seconds);
each test leaves the engine with every block back in the pool.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from pdserve.common.errors import ModelLoadError
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child in two sentences.",
    "List three fruits.",
    "What is 12 times 7? Answer with a number.",
    "Translate 'good morning' into Spanish.",
    "Give me a short tip for learning to code, and explain why it helps beginners stay "
    "motivated over many months of practice.",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """One intra-op thread: on a shared 2-core machine a second one mostly spins."""


@pytest.fixture(scope="module")
def llm(one_thread) -> LLM:
    return LLM("default", num_blocks=256)


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.tokenizer


@pytest.fixture(scope="module")
def hf(llm):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(llm.engine.loaded.model_dir,
                                                              dtype=torch.float32)
    model.eval()
    return model


def chat(tokenizer, question: str, system: str | None = None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


_memo: dict[tuple, list[int]] = {}


def hf_greedy(hf, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy continuation of one prompt (unpadded), stopping at EOS as ours does."""
    key = (tuple(ids), n)
    if key not in _memo:
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        _memo[key] = out[0, len(ids):].tolist()
    return _memo[key]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[str]:
    return [chat(tokenizer, q) for q in QUESTIONS]


@pytest.fixture(autouse=True)
def no_leaks(llm):
    yield
    llm.engine.assert_no_leaks()


def test_greedy_chat_batch_equals_transformers(llm, hf, tokenizer, prompts):
    ids = [encode(tokenizer, p) for p in prompts]
    assert len({len(i) for i in ids}) >= 6  # different lengths
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    for prompt_ids, out in zip(ids, outs):
        want = hf_greedy(hf, prompt_ids)
        assert list(out.prompt_token_ids) == prompt_ids
        assert list(out.token_ids) == want
        assert out.finish_reason == ("stop" if want[-1] in llm.engine.model_config.eos_token_ids
                                     else "length")
        assert out.text == tokenizer.decode(want, skip_special_tokens=True)
    assert {o.finish_reason for o in outs} == {"stop", "length"}  # both endings covered


def test_shared_system_prompt_computes_only_new_blocks(llm, hf, tokenizer):
    system = ("You are a meticulous assistant for a small bakery. You answer questions about "
              "opening hours, bread, pastries and cakes, politely and in one sentence.")
    first_ids = encode(tokenizer, chat(tokenizer, "When do you open on Sundays?", system))
    second_ids = encode(tokenizer, chat(tokenizer, "Do you sell rye bread?", system))
    common = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids)) if a != b)
    block = llm.engine.kv.block_size
    hit = min(common // block, (len(second_ids) - 1) // block) * block
    assert hit >= 2 * block

    params = SamplingParams(max_tokens=8, temperature=0.0)
    (first,) = llm.generate([first_ids], params)
    assert first.num_cached_tokens == 0
    before = llm.engine.stats().num_prompt_tokens_computed
    (second,) = llm.generate([second_ids], params)
    assert second.num_cached_tokens == hit
    assert second.num_computed_prompt_tokens == len(second_ids) - hit
    assert llm.engine.stats().num_prompt_tokens_computed - before == len(second_ids) - hit
    assert list(second.token_ids) == hf_greedy(hf, second_ids, 8)
    assert list(first.token_ids) == hf_greedy(hf, first_ids, 8)


def test_stop_strings_cut_the_text(llm, hf, tokenizer, prompts):
    ids = encode(tokenizer, prompts[3])
    want = hf_greedy(hf, ids)
    text = tokenizer.decode(want, skip_special_tokens=True)
    start = len(text) // 2
    stop = text[start:start + 4]
    start = text.index(stop)  # its first occurrence
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, stop=("never-said", stop))
    (out,) = llm.generate([prompts[3]], params)
    assert out.text == text[:start]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    n = len(out.token_ids)
    assert list(out.token_ids) == want[:n]  # ended at the token that completed the stop string
    assert stop in tokenizer.decode(want[:n]) and stop not in tokenizer.decode(want[:n - 1])


def test_stream_text_deltas_add_up(llm, prompts):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    deltas = list(llm.generate_stream(prompts[2], params))
    (whole,) = llm.generate([prompts[2]], params)
    assert "".join(d.new_text for d in deltas) == whole.text
    assert tuple(t for d in deltas for t in d.new_token_ids) == whole.token_ids
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])


def test_logprobs_close_to_transformers(llm, hf, tokenizer, prompts):
    ids = encode(tokenizer, prompts[1])
    n = 4
    params = SamplingParams(max_tokens=n, temperature=0.0, logprobs=5, ignore_eos=True)
    (out,) = llm.generate([prompts[1]], params)
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      return_dict_in_generate=True, output_logits=True)
    ref_lp = torch.log_softmax(torch.stack(ref.logits)[:, 0].float(), dim=-1)
    assert list(out.token_ids) == ref.sequences[0, len(ids):].tolist()
    for step, lp in enumerate(out.logprobs):
        assert lp.logprob == pytest.approx(float(ref_lp[step, lp.token_id]), abs=2e-3)
        assert [t for t, _ in lp.top][:2] == torch.topk(ref_lp[step], 2).indices.tolist()
        for t, v in lp.top:
            assert v == pytest.approx(float(ref_lp[step, t]), abs=2e-3)


def test_seeded_sampling(llm, prompts):
    def run(seed):
        params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=seed)
        return [o.text for o in llm.generate(prompts[2:5], params)]

    first = run(123)
    assert run(123) == first
    assert run(456) != first


def test_truncated_default_gguf_is_a_load_error(tmp_path):
    from pdserve.engine.default_model import locate

    source = locate()
    broken = tmp_path / "SmolLM2-truncated.gguf"
    with open(source, "rb") as f, open(broken, "wb") as g:
        g.write(f.read(1 << 20))  # the header and tensor table, then the data stops
    with pytest.raises(ModelLoadError, match="truncated"):
        LLM(str(broken), use_build_cache=False)
    with pytest.raises(ModelLoadError):
        LLM(str(tmp_path / "missing.gguf"))
    shutil.rmtree(tmp_path)


@pytest.mark.parametrize("mode", ["gguf", "auto"])
def test_gguf_blocks_give_transformers_greedy_text(hf, tokenizer, prompts, mode, caplog):
    """`--quantization gguf` (and `auto`, which picks it for a .gguf on CPU): every linear from
    the file's own blocks (210 Q4_1 + the tied Q8_0 embedding/output), greedy text as
    transformers' over the same file dequantized."""
    with caplog.at_level("INFO", logger="pdserve.engine.gguf_weights"):
        quantized = LLM("default", num_blocks=128, quantization=mode)
    assert quantized.engine.config.quantization == "gguf"
    assert "210 Q4_1" in caplog.text and "1 Q8_0" in caplog.text
    model = quantized.engine.model
    assert model.lm_head.weight is None and all(
        linear.weight is None for layer in model.layers for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    ids = [encode(tokenizer, p) for p in prompts]
    outs = quantized.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    for prompt_ids, out in zip(ids, outs):
        assert list(out.token_ids) == hf_greedy(hf, prompt_ids)
    quantized.engine.assert_no_leaks()


def test_gguf_quantization_needs_a_gguf_model(tmp_path, llm):
    shutil.copytree(llm.engine.loaded.model_dir, tmp_path / "plain")
    with pytest.raises(ModelLoadError, match="not a GGUF model"):
        LLM(str(tmp_path / "plain"), num_blocks=16, quantization="gguf")
    assert LLM(str(tmp_path / "plain"), num_blocks=16, quantization="auto").engine.config.quantization == ""

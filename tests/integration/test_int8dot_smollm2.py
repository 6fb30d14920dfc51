"""`--quantization gguf-int8dot` and `gguf-int16dot` on the default model (SmolLM2-135M-Instruct's Q4_1 and Q8_0
blocks): every linear runs the integer-dot kernel in decode steps, and greedy answers to a few
chat prompts, decoded together (decode-sized steps), agree with the float32 engine's: at
least 2 of 4 identical over 16 tokens, and every answer's first 8 tokens equal (this machine's
AVX-512 VNNI path: all 4 in both modes; over 32 tokens one of gguf-int8dot's differs from its
18th). Quantized activation blocks move each logit a little; a near tie late in an answer may flip."""
from __future__ import annotations

import pytest

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels.int8_dot import Int8DotLinear

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three fruits.",
             "Explain gravity to a child in two sentences."]


@pytest.fixture(scope="module")
def fp32(one_torch_thread) -> LLM:
    return LLM("default", num_blocks=128, quantization="")


@pytest.mark.parametrize("mode", ["gguf-int8dot", "gguf-int16dot"])
def test_default_model_in_integer_dot_mode_agrees_with_float32(fp32, mode):
    int8dot = LLM("default", num_blocks=128, quantization=mode)
    linears = int8dot.engine.model.linears()
    assert all(isinstance(lin._fast, Int8DotLinear) for lin in linears)
    assert {lin._fast.weight.type_name for lin in linears} == {"Q4_1", "Q8_0"}
    prompts = [fp32.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                  add_generation_prompt=True) for q in QUESTIONS]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in fp32.generate(prompts, params)]
    got = [o.token_ids for o in int8dot.generate(prompts, params)]
    assert sum(g == w for g, w in zip(got, want)) >= 2
    assert all(g[:8] == w[:8] for g, w in zip(got, want))
    for llm in (fp32, int8dot):
        llm.engine.assert_no_leaks()

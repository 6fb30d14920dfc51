"""LoRA on the default model (SmolLM2-135M-Instruct from its GGUF) under every quantization
mode, with an adapter written in PEFT's format in the test (random, non-zero A and B).

Exact GGUF blocks (`gguf`) and float32 weights give transformers' greedy text with the
adapter merged in, base and adapter requests in one batch. The approximate modes (int8,
gguf-fast, gguf-int8dot, gguf-int16dot) change the base linears' numbers, not the LoRA
update, which is added on their float outputs: the change the adapter makes to the
log-probabilities of the base model's greedy text is the change it makes in float32: at the
same scale (a least-squares fit), and within the mode's own error token by token where that
error is small (not int8's; int8 errs more on weights with the adapter merged into them than
with the adapter applied beside them).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_adapters import greedy, merged_reference, write_adapter
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.loader import load_model
from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NEW = 12
QUESTIONS = ["What is the capital of France?", "List three fruits."]


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """One intra-op thread: on a shared 2-core machine a second one mostly spins."""


@pytest.fixture(scope="module")
def loaded(one_thread):
    return load_model("default")


@pytest.fixture(scope="module")
def adapter_dir(loaded, tmp_path_factory) -> Path:
    return write_adapter(tmp_path_factory.mktemp("smol-lora") / "a", Path(loaded.model_dir), rank=8, alpha=16,
                         seed=1, std=0.1)


@pytest.fixture(scope="module")
def gentle_dir(loaded, tmp_path_factory) -> Path:
    """An adapter that moves the model's log-probabilities without wrecking its text."""
    return write_adapter(tmp_path_factory.mktemp("smol-lora") / "g", Path(loaded.model_dir), rank=8, alpha=16,
                         seed=2, std=0.07)


@pytest.fixture(scope="module")
def hf(loaded, adapter_dir, gentle_dir):
    return {None: merged_reference(loaded.model_dir, None), "a": merged_reference(loaded.model_dir, adapter_dir),
            "g": merged_reference(loaded.model_dir, gentle_dir)}


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    tok = loaded.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                               add_generation_prompt=True), add_special_tokens=False)
            for q in QUESTIONS]


def make_llm(loaded, adapter_dir, quantization: str) -> LLM:
    config = EngineConfig(model="default", quantization=quantization, enable_lora=True, max_lora_rank=8)
    llm = LLM(config=config, loaded=loaded, num_blocks=128)
    llm.load_lora("a", str(adapter_dir))
    return llm


@pytest.mark.parametrize("quantization", ["gguf", ""])
def test_greedy_text_equals_transformers_with_the_adapter_merged(loaded, adapter_dir, hf, prompts, quantization):
    llm = make_llm(loaded, adapter_dir, quantization)
    names = [None, "a"] * len(prompts)
    batch = [p for p in prompts for _ in range(2)]
    outs = llm.generate(batch, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True), lora_name=names)
    expected = [greedy(hf[n], p, NEW) for n, p in zip(names, batch)]
    assert [list(o.token_ids) for o in outs] == expected
    assert expected[0] != expected[1]  # the adapter changes the text
    llm.engine.assert_no_leaks()


def _hf_logprobs(model, ids: list[int], start: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[start - 1:-1].gather(1, torch.tensor(ids[start:])[:, None])[:, 0]


@pytest.mark.parametrize("quantization", ["int8", "gguf-fast", "gguf-int8dot", "gguf-int16dot"])
def test_approximate_modes_apply_the_same_update(loaded, gentle_dir, hf, prompts, quantization):
    """The adapter's change to the log-probabilities of the base model's greedy text is
    the float model's change: their own error cancels between base and adapter runs."""
    llm = make_llm(loaded, gentle_dir, quantization)  # its adapter "a" is the gentle one here
    prompt = prompts[0]
    text = prompt + greedy(hf[None], prompt, NEW)
    wanted = _hf_logprobs(hf["g"], text, len(prompt)) - _hf_logprobs(hf[None], text, len(prompt))
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    ours = {}
    for name in (None, "a"):
        out = llm.generate([text], params, lora_name=name)[0]
        ours[name] = torch.tensor([e.logprob for e in out.prompt_logprobs[len(prompt) - 1:]])
    change = ours["a"] - ours[None]
    error = (change - wanted).abs().mean().item()
    moved = wanted.abs().mean().item()
    assert moved > 0.5, moved
    # the least-squares scale of our change against the float one: 1 for the update applied
    # once at its scale, 0 for one left out, 0.5 or 2 for one at half or twice its scale
    scale = float((change * wanted).sum() / (wanted * wanted).sum())
    assert 0.8 < scale < 1.25, scale
    # and per token: an update left out, or applied at twice or half its scale, errs by half
    # `moved` or more. Not for int8: its own error (dynamic activation scales) is as large as
    # the change on some tokens, and its mean moves across that bound with the summation
    # order of any kernel in the forward; the fitted scale above does not
    if quantization != "int8":
        assert error < 0.45 * moved, (error, moved)
    llm.engine.assert_no_leaks()

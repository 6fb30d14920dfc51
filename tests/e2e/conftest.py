"""End-to-end fixtures. The harness (deployments, leak checks) is in harness.py."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test modules import harness

@pytest.fixture(scope="session")
def hf_model():
    """(tokenizer, the default model in transformers, fp32)."""
    import torch
    import transformers

    from pdserve.engine.loader import load_model

    loaded = load_model("default")
    return loaded.tokenizer, transformers.AutoModelForCausalLM.from_pretrained(loaded.model_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_reference(hf_model):
    """(tokenizer, greedy(messages or prompt, max_tokens) -> text) from transformers itself."""
    import torch

    tok, model = hf_model
    cache: dict = {}

    def greedy(prompt, max_tokens: int) -> str:
        key = (repr(prompt), max_tokens)
        if key not in cache:
            if isinstance(prompt, list):
                ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
            else:
                ids = tok(prompt).input_ids
            out = model.generate(torch.tensor([list(ids)]), max_new_tokens=max_tokens, do_sample=False)
            cache[key] = tok.decode(out[0, len(ids):], skip_special_tokens=True)
        return cache[key]

    return tok, greedy

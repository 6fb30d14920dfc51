"""Fixtures of the network lab's tests: skip where namespaces are not allowed, and
transformers' greedy text as the oracle."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def lab_allowed() -> None:
    """Skips, with the reason, where a lab cannot be built (not root, no iproute2, no netns)."""
    from pdserve.bench.netlab import unavailable

    reason = unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def greedy():
    """(tokenizer, greedy(prompt, max_tokens) -> text) from transformers on the default model."""
    import torch
    import transformers

    from pdserve.engine.loader import load_model

    loaded = load_model("default")
    tok = loaded.tokenizer
    model = transformers.AutoModelForCausalLM.from_pretrained(loaded.model_dir, dtype=torch.float32)

    def run(prompt: str, max_tokens: int) -> str:
        ids = tok(prompt).input_ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
        return tok.decode(out[0, len(ids):], skip_special_tokens=True)

    return tok, run

"""Speculative decoding under a LoRA adapter: the drafts a request's rows verify run under
its adapter, so greedy output with scripted drafts (right ones kept, a wrong one at a moving
place) equals the merged model's, for adapter and base requests in one batch, and every KV
block and adapter slot is back at the end. The serving path (decode) runs the same engine."""
from __future__ import annotations

import numpy as np
import pytest

from lora_adapters import greedy, merged_reference, write_adapter
from pdserve.engine import speculation
from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

K = 4
NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * n) % 250 + 3 for i in range(n)] for n in (5, 17, 33)]


class FreeRows:
    """A step cost where rows are free: every proposed draft runs."""

    ratio = 0.0

    def note(self, rows: int, seconds: float) -> None:
        pass


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """Tiny matmuls run fastest on one thread."""


def test_drafts_verified_under_the_adapter_keep_its_output(tiny_model_factory, tmp_path, monkeypatch):
    model_dir = tiny_model_factory("llama")
    adapter = write_adapter(tmp_path / "a", model_dir, seed=11)
    names = ["a", None, "a"]
    refs = {None: merged_reference(model_dir, None), "a": merged_reference(model_dir, adapter)}
    expected = {(name, tuple(p)): greedy(refs[name], p, NEW) for name, p in zip(names, PROMPTS)}
    offered = []

    def propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
        seq = tokens.tolist()
        for (_, prompt), continuation in expected.items():
            if tuple(seq[:len(prompt)]) == prompt:
                done = len(seq) - len(prompt)
                drafts = list(continuation[done:done + k])
                wrong = done % (K + 1)
                if wrong < len(drafts):
                    drafts[wrong] = (drafts[wrong] + 1) % 250 + 3
                offered.append(len(drafts))
                return np.array(drafts, dtype=np.int32)
        raise AssertionError("an unknown sequence")

    monkeypatch.setattr(speculation, "propose", propose)
    llm = LLM(str(model_dir), enable_lora=True, num_blocks=96,
              speculative=SpeculativeConfig(num_speculative_tokens=K))
    llm.engine.speculator.cost = FreeRows()
    llm.load_lora("a", str(adapter))
    outs = llm.generate(PROMPTS, GREEDY, lora_name=names)
    assert [list(o.token_ids) for o in outs] == [expected[(n, tuple(p))] for n, p in zip(names, PROMPTS)]
    stats = llm.engine.stats()
    assert sum(offered) > 0 and stats.num_draft_tokens > stats.num_accepted_tokens > 0
    llm.engine.assert_no_leaks()

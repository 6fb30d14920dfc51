"""A GGUF other than the default one through `--quantization gguf`: the synthetic Llama that
`pdserve bench gguf-1b` writes, at a tiny shape (GQA: 4 heads over 2 KV heads, so the q and k
rows come back in transformers' order with different head counts). Every linear is served
from its blocks and greedy tokens equal the float32 engine's over the same file."""
from __future__ import annotations

import pytest

from pdserve.bench.synthetic_gguf import write_gguf
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def test_synthetic_gguf_served_from_its_blocks_equals_float32(tmp_path):
    path = write_gguf(tmp_path / "tiny.Q4_1.gguf", hidden=128, layers=2, ffn=256, heads=4, kv_heads=2, seed=3)
    fp32 = LLM(str(path), quantization="", num_blocks=64)
    blocks = LLM(str(path), quantization="gguf", num_blocks=64)
    assert blocks.engine.compat_hash == fp32.engine.compat_hash  # exact blocks: interchangeable KV
    linears = blocks.engine.model.linears()
    assert len(linears) == 2 * 4 + 1 and all(lin.weight is None and lin._blocks is not None for lin in linears)
    assert {lin._blocks.type_name for lin in linears} == {"Q4_1", "Q8_0"}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[300, 400, 500, 600], list(range(1000, 1050)), [7] * 33]
    want = [o.token_ids for o in fp32.generate(prompts, params)]
    assert [o.token_ids for o in blocks.generate(prompts, params)] == want
    fast = LLM(str(path), quantization="gguf-fast", num_blocks=64)
    assert fast.engine.compat_hash != fp32.engine.compat_hash
    assert all(len(o.token_ids) == 12 for o in fast.generate(prompts, params))
    for llm in (fp32, blocks, fast):
        llm.engine.assert_no_leaks()

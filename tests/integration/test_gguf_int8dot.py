"""`--quantization gguf-int8dot` (and `gguf-int16dot`) on a tiny random GGUF (the synthetic Llama of `pdserve bench
gguf-1b`): every linear runs the integer-dot kernel in decode steps, and greedy decoding agrees
with the float32 engine over the same file on at least 14 of 16 prompts (16 tokens each, every
prompt agreeing on its first 4). 8-bit activation blocks move each logit a little, so a near tie
may flip; the bound leaves room for that on another CPU's path and no more. The KV differs from
float32's, so the compatibility hash does too."""
from __future__ import annotations

import random

import pytest

from pdserve.bench.synthetic_gguf import write_gguf
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels.int8_dot import Int8DotLinear

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["gguf-int8dot", "gguf-int16dot"])
def test_integer_dot_mode_agrees_with_float32(tmp_path, mode):
    path = write_gguf(tmp_path / "tiny.Q4_1.gguf", hidden=128, layers=2, ffn=256, heads=4, kv_heads=2, seed=3)
    fp32 = LLM(str(path), quantization="", num_blocks=128)
    int8dot = LLM(str(path), quantization=mode, num_blocks=128)
    assert int8dot.engine.compat_hash != fp32.engine.compat_hash
    linears = int8dot.engine.model.linears()
    assert len(linears) == 2 * 4 + 1 and all(isinstance(lin._fast, Int8DotLinear) for lin in linears)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 40))] for _ in range(16)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in fp32.generate(prompts, params)]
    got = [o.token_ids for o in int8dot.generate(prompts, params)]
    assert all(len(g) == 16 for g in got)
    assert sum(g == w for g, w in zip(got, want)) >= 14
    assert all(g[:4] == w[:4] for g, w in zip(got, want))
    for llm in (fp32, int8dot):
        llm.engine.assert_no_leaks()


def test_offline_bench_prints_each_step_beside_its_bound(tmp_path, capsys):
    """`bench offline` on the integer-dot mode (a smoke test, not a timing): the machine's
    rates, path and CPU, and each decode step with its weight-read and multiply-add bounds."""
    from pdserve.bench import offline
    from pdserve.kernels import int8_dot

    path = write_gguf(tmp_path / "tiny.Q4_1.gguf", hidden=128, layers=2, ffn=256, heads=4, kv_heads=2, seed=3)
    rc = offline.main(["--model", str(path), "--quantization", "gguf-int8dot", "--no-transformers",
                       "--threads", "1", "--concurrency", "2", "--new-tokens", "4", "--prompt-len", "20",
                       "--prefill-len", "64", "--decode-batches", "1", "8"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"integer dot ({int8_dot.chosen_isa()} path)" in printed and int8_dot.cpu_model() in printed
    steps = [line for line in printed.splitlines() if line.startswith("decode step, batch")]
    assert len(steps) == 2 and all("step/bound" in line and "GB/s" in line for line in steps)
    assert all("G float32" in line and "G integer dot" in line for line in steps)
    assert "0.000 G integer dot" not in steps[0]  # the decode rows ran the integer-dot kernel

"""LoRA on CUDA: the Triton `add_lora` against its reference, and the engine's greedy text
with base and adapter rows in one batch against transformers with the adapters merged."""
from __future__ import annotations

import pytest
import torch

from lora_adapters import greedy, merged_reference, write_adapter
from pdserve.kernels.lora import add_lora, reference_add_lora, runs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_rows", [1, 7, 300])
def test_triton_add_lora_on_cuda(dtype, tol, num_rows):
    g = torch.Generator().manual_seed(num_rows)
    slot_list = [(i % 5) - 1 for i in range(num_rows)]  # -1 (none) and slots 0..3, interleaved
    widths, fan_in, rank = (576, 192, 192), 576, 16
    x = torch.randn(num_rows, fan_in, generator=g)
    y = torch.randn(num_rows, sum(widths), generator=g)
    a = torch.randn(4, len(widths) * rank, fan_in, generator=g) * 0.05
    bs = [torch.randn(4, w, rank, generator=g) * 0.1 for w in widths]
    slots = torch.tensor(slot_list, dtype=torch.int32)
    expected = reference_add_lora(y, x, a, bs, slots)
    cuda = [t.to("cuda", dtype) for t in (y, x, a)]
    out = add_lora(cuda[0], cuda[1], cuda[2], [b.to("cuda", dtype) for b in bs], slots.cuda(), runs(slot_list))
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol * 10, rtol=tol)


def test_engine_on_cuda_mixes_base_and_adapters(tiny_model_factory, tmp_path):
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    model_dir = tiny_model_factory("llama")
    paths = {"a": write_adapter(tmp_path / "a", model_dir, seed=1),
             "b": write_adapter(tmp_path / "b", model_dir, targets=("q_proj", "v_proj"), rank=8, seed=2)}
    llm = LLM(str(model_dir), device="cuda", num_blocks=64, enable_lora=True, max_loras=2)
    for name, path in paths.items():
        llm.load_lora(name, str(path))
    names = [None, "a", "b", "a"]
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 33, 40)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), lora_name=names)
    expected = [greedy(merged_reference(model_dir, paths[n] if n else None), p, 8) for n, p in zip(names, prompts)]
    assert [list(o.token_ids) for o in outs] == expected
    llm.engine.assert_no_leaks()

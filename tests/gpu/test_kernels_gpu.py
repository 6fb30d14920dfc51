"""The Triton kernels on a real GPU, at realistic sizes. Skipped without CUDA.

Expected values come from the torch paths (`kernels.torch_paths`, run on the same GPU),
which the CPU unit tests hold to the loop-by-loop references; one medium-size case per
op also checks against the reference directly. Tolerances: fp32 1e-4 (longer sums than
the CPU tests, and a different summation order), bf16 3e-2 (abs and rel): one bf16 ulp at
|x| in [2, 4) is 1.6e-2, and the kernels round softmax weights to bf16 before the PV
product. Block moves are exact.
"""
from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.kernels import reference, synthetic, torch_paths

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
CUDA = "cuda"


@pytest.fixture(autouse=True)
def _triton_on_cuda(monkeypatch):
    monkeypatch.setenv("PDSERVE_USE_TRITON", "auto")  # CUDA tensors -> Triton


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[expected.dtype])


def ragged(batch: int, longest: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, longest + 1, (batch,), generator=gen).tolist()
    lens[0] = longest
    return lens


# (num_heads, num_kv_heads, head_dim, block_size, window)
SHAPES = [
    (32, 32, 128, 16, None),   # GQA 1
    (9, 3, 64, 16, None),      # GQA 3 (SmolLM2)
    (32, 8, 128, 16, None),    # GQA 4 (Llama-3-8B)
    (32, 8, 128, 32, 1024),    # window
    (28, 4, 128, 32, None),    # GQA 7 (Qwen2-7B)
    (16, 4, 64, 32, 300),
]
SHAPE_IDS = [f"h{s[0]}kv{s[1]}d{s[2]}bs{s[3]}w{s[4]}" for s in SHAPES]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_decode_matches_torch_path(shape, dtype):
    num_heads, num_kv_heads, head_dim, block_size, window = shape
    lens = ragged(48, 4096) + [0]  # a padded slot (context 0) too
    batch = synthetic.random_paged_batch(lens, num_kv_heads, head_dim, block_size, dtype, CUDA)
    query = synthetic.random_queries(len(lens), num_heads, head_dim, dtype, CUDA)
    args = (query, batch.kv_cache, batch.block_tables, batch.context_lens, head_dim ** -0.5, window)
    out = kernels.paged_decode_attention(*args)
    close(out, torch_paths.paged_decode_attention(*args))
    assert not out[-1].any()


@pytest.mark.parametrize("num_splits", [1, 2, 7, 16, 64])
def test_decode_splits_agree(num_splits):
    from pdserve.kernels import triton_attention

    batch = synthetic.random_paged_batch(ragged(8, 3000), 8, 128, 16, torch.bfloat16, CUDA)
    query = synthetic.random_queries(8, 32, 128, torch.bfloat16, CUDA)
    args = (query, batch.kv_cache, batch.block_tables, batch.context_lens, 128 ** -0.5)
    out = triton_attention.paged_decode_attention(*args, num_splits=num_splits)
    close(out, torch_paths.paged_decode_attention(*args))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matches_reference(dtype):
    batch = synthetic.random_paged_batch([1, 200, 517, 64], 8, 128, 16, dtype, CUDA)
    query = synthetic.random_queries(4, 32, 128, dtype, CUDA)
    args = (query, batch.kv_cache, batch.block_tables, batch.context_lens, 128 ** -0.5, 100)
    close(kernels.paged_decode_attention(*args), reference.paged_decode_attention(*args))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_prefill_matches_torch_path(shape, dtype):
    num_heads, num_kv_heads, head_dim, block_size, window = shape
    q_lens = [2048, 1, 700, 0, 129]
    lens = [2048, 3000, 1400, 40, 129]  # fresh, decode-like, chunk after a prefix, empty, fresh
    batch = synthetic.random_paged_batch(lens, num_kv_heads, head_dim, block_size, dtype, CUDA)
    query = synthetic.random_queries(sum(q_lens), num_heads, head_dim, dtype, CUDA)
    starts = synthetic.query_start_loc(q_lens, CUDA)
    args = (query, batch.kv_cache, batch.block_tables, starts, batch.context_lens, head_dim ** -0.5, window)
    out = kernels.paged_prefill_attention(*args)
    close(out, torch_paths.paged_prefill_attention(*args))
    close(kernels.paged_prefill_attention(*args, max_query_len=max(q_lens)), out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_matches_reference(dtype):
    q_lens, lens = [100, 37], [100, 160]
    batch = synthetic.random_paged_batch(lens, 2, 128, 32, dtype, CUDA)
    query = synthetic.random_queries(sum(q_lens), 8, 128, dtype, CUDA)
    args = (query, batch.kv_cache, batch.block_tables, synthetic.query_start_loc(q_lens, CUDA),
            batch.context_lens, 128 ** -0.5, 50)
    close(kernels.paged_prefill_attention(*args), reference.paged_prefill_attention(*args))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [(8, 128, 16), (3, 64, 32), (4, 64, 16)], ids=str)
def test_store_kv_matches_torch_path(case, dtype):
    num_kv_heads, head_dim, block_size = case
    num_blocks, num_tokens = 1024, 4096
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, device=CUDA).to(dtype)
    expected = cache.clone()
    fused = torch.randn(num_tokens, 6 * num_kv_heads, head_dim, device=CUDA).to(dtype)
    key, value = fused[:, 4 * num_kv_heads:5 * num_kv_heads], fused[:, 5 * num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, device=CUDA)[:num_tokens]
    slots[::7] = -1  # padding
    kernels.store_kv(key, value, cache, slots)
    torch_paths.store_kv(key, value, expected, slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gather_scatter_match_torch_path(dtype):
    layers = [torch.randn(512, 2, 16, 8, 128, device=CUDA).to(dtype) for _ in range(32)]
    block_ids = torch.randperm(512, device=CUDA)[:200]
    buffer = kernels.gather_blocks(layers, block_ids)
    expected = torch.empty_like(buffer)
    torch_paths.gather_blocks(layers, block_ids, expected)
    assert torch.equal(buffer, expected)
    assert torch.equal(buffer, reference.gather_blocks(layers, block_ids))

    incoming = torch.randn_like(buffer, dtype=torch.float32).to(dtype)
    written, expected_layers = [t.clone() for t in layers], [t.clone() for t in layers]
    kernels.scatter_blocks(incoming, written, block_ids)
    torch_paths.scatter_blocks(incoming, expected_layers, block_ids)
    assert all(torch.equal(a, b) for a, b in zip(written, expected_layers))

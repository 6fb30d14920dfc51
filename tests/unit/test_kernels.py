"""Kernels against their references: the torch paths here, the Triton kernels under
Triton's CPU interpreter.

The interpreter must be switched on before triton compiles (decorates) a kernel, so the
Triton cases do not run in this pytest process: `test_triton_kernels_under_interpreter`
runs this same file in a child process with TRITON_INTERPRET=1, selecting the cases whose
id holds `triton_interp`. (Run the whole file with TRITON_INTERPRET=1 set and they run
in-process instead.) Nothing here changes this process's environment for other modules.

On CPU the decode wrapper runs the native C++ kernel (`cpu_native`, built on first use)
unless PDSERVE_CPU_ATTENTION=torch: the `native` and `torch` cases cover both.

Tolerances, against the fp32 references: fp32 inputs 1e-5 (abs and rel; observed ~1e-6);
bf16 inputs 2e-2 (abs and rel): one bf16 ulp at |x| in [2, 4) is 1.6e-2, and the kernels
round the softmax weights to bf16 before the PV product as GPU kernels do. Block moves
(store, gather, scatter) are exact.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve import kernels
from pdserve.kernels import reference, synthetic
from pdserve.kernels.dispatch import interpreting, triton_installed

INTERPRETED = interpreting()
# native: the C++ CPU decode attention (other kernels have no native variant: same as torch)
PATHS = ["native", "torch", "triton_interp"] if INTERPRETED else ["native", "torch"]
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    monkeypatch.setenv("PDSERVE_USE_TRITON", "1" if request.param == "triton_interp" else "0")
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "native" if request.param == "native" else "torch")
    return request.param


@pytest.fixture(autouse=True)
def _few_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(min(previous, 2))
    yield
    torch.set_num_threads(previous)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[expected.dtype])


# (num_heads, num_kv_heads, head_dim, block_size, window, context_lens)
DECODE_CASES = [
    (4, 4, 64, 16, None, [1, 37, 150, 0]),   # GQA 1; a padded batch slot (context 0) -> zeros
    (9, 3, 64, 16, None, [17, 64, 129]),      # GQA 3 (SmolLM2's heads)
    (9, 3, 64, 32, 24, [5, 33, 100]),         # window shorter and longer than the context
    (8, 2, 128, 32, None, [31, 96, 200]),     # GQA 4, head dim 128
    (8, 2, 128, 16, 40, [16, 41, 150]),
    (8, 8, 64, 16, 50, [3, 70]),              # 8 KV heads: the torch path's head-major branch
    (4, 2, 96, 16, None, [20, 70]),           # head dim not a power of two (padded lanes)
    # the native float32 kernel's group sizes: in registers (1-4 heads of 64, 1-2 of 128), any other
    (8, 4, 64, 16, None, [9, 77]),
    (16, 4, 64, 16, 30, [40, 3]),
    (14, 2, 64, 16, None, [25, 60]),
    (4, 4, 128, 16, None, [30, 1]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"h{c[0]}kv{c[1]}d{c[2]}bs{c[3]}w{c[4]}")
def test_decode_matches_reference(path, case, dtype):
    num_heads, num_kv_heads, head_dim, block_size, window, lens = case
    batch = synthetic.random_paged_batch(lens, num_kv_heads, head_dim, block_size, dtype)
    query = synthetic.random_queries(len(lens), num_heads, head_dim, dtype)
    scale = head_dim ** -0.5
    out = kernels.paged_decode_attention(query, batch.kv_cache, batch.block_tables, batch.context_lens,
                                         scale, window)
    expected = reference.paged_decode_attention(query, batch.kv_cache, batch.block_tables,
                                                batch.context_lens, scale, window)
    close(out, expected)
    if 0 in lens:
        assert not out[lens.index(0)].any()


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"h{c[0]}kv{c[1]}d{c[2]}bs{c[3]}w{c[4]}")
def test_torch_decode_in_passes_of_one_sequence(case, monkeypatch):
    """The torch path gathers a few sequences per pass; force one per pass."""
    from pdserve.kernels import torch_paths

    monkeypatch.setattr(torch_paths, "_GATHER_BUDGET_BYTES", 1)
    num_heads, num_kv_heads, head_dim, block_size, window, lens = case
    batch = synthetic.random_paged_batch(lens, num_kv_heads, head_dim, block_size)
    query = synthetic.random_queries(len(lens), num_heads, head_dim)
    args = (query, batch.kv_cache, batch.block_tables, batch.context_lens, 0.1, window)
    close(torch_paths.paged_decode_attention(*args), reference.paged_decode_attention(*args))


@pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter child process")
@pytest.mark.parametrize("num_splits", [1, 2, 3, 8], ids=lambda n: f"triton_interp-splits{n}")
def test_decode_splits_agree(num_splits):
    from pdserve.kernels import triton_attention

    lens = [1, 64, 65, 190]
    batch = synthetic.random_paged_batch(lens, 2, 64, 16)
    query = synthetic.random_queries(len(lens), 6, 64)
    out = triton_attention.paged_decode_attention(query, batch.kv_cache, batch.block_tables,
                                                  batch.context_lens, 0.125, None, num_splits=num_splits)
    close(out, reference.paged_decode_attention(query, batch.kv_cache, batch.block_tables,
                                                batch.context_lens, 0.125))


# (num_heads, num_kv_heads, head_dim, block_size, window, query_lens, context_lens)
PREFILL_CASES = [
    (4, 4, 64, 16, None, [5, 0, 40], [5, 20, 150]),  # fresh prompt, empty chunk, chunk after 110 cached
    (9, 3, 64, 32, None, [33, 7], [33, 90]),
    (9, 3, 64, 16, 10, [20, 12], [20, 60]),
    (8, 2, 128, 32, 24, [70, 1], [70, 65]),          # two query tiles; a one-token chunk
    (8, 2, 128, 16, None, [16, 30], [48, 30]),
    (4, 2, 96, 32, None, [20, 5], [20, 70]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"h{c[0]}kv{c[1]}d{c[2]}bs{c[3]}w{c[4]}")
def test_prefill_matches_reference(path, case, dtype):
    num_heads, num_kv_heads, head_dim, block_size, window, q_lens, lens = case
    batch = synthetic.random_paged_batch(lens, num_kv_heads, head_dim, block_size, dtype)
    query = synthetic.random_queries(sum(q_lens), num_heads, head_dim, dtype)
    starts = synthetic.query_start_loc(q_lens)
    scale = head_dim ** -0.5
    out = kernels.paged_prefill_attention(query, batch.kv_cache, batch.block_tables, starts,
                                          batch.context_lens, scale, window)
    expected = reference.paged_prefill_attention(query, batch.kv_cache, batch.block_tables, starts,
                                                 batch.context_lens, scale, window)
    close(out, expected)


def test_prefill_of_whole_prompt_matches_decode_of_its_last_token(path):
    """The last row of a prefill and a decode step at the same position see the same keys."""
    batch = synthetic.random_paged_batch([45], 3, 64, 16)
    query = synthetic.random_queries(45, 9, 64)
    full = kernels.paged_prefill_attention(query, batch.kv_cache, batch.block_tables,
                                           synthetic.query_start_loc([45]), batch.context_lens, 0.125, 20)
    last = kernels.paged_decode_attention(query[-1:], batch.kv_cache, batch.block_tables,
                                          batch.context_lens, 0.125, 20)
    close(full[-1:], last)


# (num_kv_heads, head_dim, block_size)
MOVE_CASES = [(4, 64, 16), (3, 64, 32), (2, 128, 16), (8, 128, 32)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", MOVE_CASES, ids=lambda c: f"kv{c[0]}d{c[1]}bs{c[2]}")
def test_store_kv_matches_reference(path, case, dtype):
    num_kv_heads, head_dim, block_size = case
    num_blocks, num_heads = 5, 2 * num_kv_heads
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim).to(dtype)
    expected = cache.clone()
    # key/value are views into a fused qkv projection: strided token dim, as the engine has them.
    fused = torch.randn(7, num_heads + 2 * num_kv_heads, head_dim).to(dtype)
    key, value = fused[:, num_heads:num_heads + num_kv_heads], fused[:, num_heads + num_kv_heads:]
    last = num_blocks * block_size - 1
    slots = torch.tensor([0, block_size + 3, -1, last, 2 * block_size, -1, block_size - 1])
    kernels.store_kv(key, value, cache, slots)
    reference.store_kv(key, value, expected, slots)
    assert torch.equal(cache, expected)
    assert torch.equal(cache[0, 0, 0], key[0]) and torch.equal(cache[-1, 1, -1], value[3])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", MOVE_CASES[:2], ids=lambda c: f"kv{c[0]}d{c[1]}bs{c[2]}")
def test_gather_scatter_match_reference(path, case, dtype):
    num_kv_heads, head_dim, block_size = case
    layers = [torch.randn(6, 2, block_size, num_kv_heads, head_dim).to(dtype) for _ in range(3)]
    block_ids = torch.tensor([4, 0, 5])
    gathered = kernels.gather_blocks(layers, block_ids)
    assert gathered.shape == (3, 3, 2, block_size, num_kv_heads, head_dim) and gathered.is_contiguous()
    assert torch.equal(gathered, reference.gather_blocks(layers, block_ids))
    out = torch.empty_like(gathered)
    assert kernels.gather_blocks(layers, block_ids, out=out) is out and torch.equal(out, gathered)

    buffer = torch.randn_like(gathered, dtype=torch.float32).to(dtype)
    written, expected = [t.clone() for t in layers], [t.clone() for t in layers]
    kernels.scatter_blocks(buffer, written, block_ids)
    reference.scatter_blocks(buffer, expected, block_ids)
    assert all(torch.equal(a, b) for a, b in zip(written, expected))
    assert torch.equal(kernels.gather_blocks(written, block_ids), buffer)  # round trip


def test_empty_inputs(path):
    cache = torch.zeros(2, 2, 16, 1, 64)
    kernels.store_kv(torch.empty(0, 1, 64), torch.empty(0, 1, 64), cache, torch.empty(0, dtype=torch.int64))
    assert not cache.any()
    assert kernels.gather_blocks([cache], torch.empty(0, dtype=torch.int64)).shape == (0, 1, 2, 16, 1, 64)
    out = kernels.paged_decode_attention(torch.empty(0, 2, 64), cache, torch.empty(0, 1, dtype=torch.int32),
                                         torch.empty(0, dtype=torch.int32), 0.1)
    assert out.shape == (0, 2, 64)


def test_fast_decode_matches_reference_at_smollm2_shape(monkeypatch):
    """The CPU serving path at the engine's shape: batch 32, ~300-token contexts, 9/3 heads."""
    monkeypatch.setenv("PDSERVE_USE_TRITON", "auto")
    lens = [300 + (i * 7) % 41 - 20 for i in range(32)]
    batch = synthetic.random_paged_batch(lens, 3, 64, 16)
    query = synthetic.random_queries(32, 9, 64)
    out = kernels.paged_decode_attention(query, batch.kv_cache, batch.block_tables, batch.context_lens, 0.125)
    close(out, reference.paged_decode_attention(query, batch.kv_cache, batch.block_tables,
                                                batch.context_lens, 0.125))


def test_native_build_failure_falls_back_with_a_warning_or_fails_loudly(monkeypatch, caplog):
    from pdserve.kernels import cpu_native

    monkeypatch.setenv("PDSERVE_USE_TRITON", "0")
    monkeypatch.setattr(cpu_native, "_load", lambda: RuntimeError("no C++ compiler"))
    cpu_native._warn_once.cache_clear()
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "auto")
    with caplog.at_level("WARNING", logger="pdserve.kernels.cpu_native"):
        assert cpu_native.backend_name() == "torch"
    assert "no C++ compiler" in caplog.text  # never a silent fallback
    args = _decode_args()
    close(kernels.paged_decode_attention(**args), reference.paged_decode_attention(*args.values()))
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "native")
    with pytest.raises(cpu_native.NativeBuildError, match="no C..? compiler|did not build"):
        cpu_native.backend_name()
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "fast")
    with pytest.raises(ValueError, match="PDSERVE_CPU_ATTENTION"):
        cpu_native.backend_name()


def test_native_build_is_reused_and_named_by_this_cpu():
    from pdserve.kernels import cpu_native

    module = cpu_native._load()
    assert not isinstance(module, Exception), module
    assert cpu_native._load() is module
    assert module.__name__.startswith("pdserve_cpu_attention_")
    assert module.__name__.endswith(cpu_native._fingerprint(cpu_native.source_text(), cpu_native._flags()))


# --- argument checks -------------------------------------------------------------------

def _decode_args(**changes):
    batch = synthetic.random_paged_batch([20, 5], 2, 64, 16)
    args = dict(query=synthetic.random_queries(2, 4, 64), kv_cache=batch.kv_cache,
                block_tables=batch.block_tables, context_lens=batch.context_lens, scale=0.125)
    args.update(changes)
    return args


@pytest.mark.parametrize("change", [
    dict(query=torch.randn(2, 3, 64)),                          # 3 heads over 2 KV heads
    dict(query=torch.randn(2, 4, 32)),                          # head_dim mismatch
    dict(query=torch.randn(2, 4, 64, dtype=torch.float64)),     # dtype mismatch
    dict(query=torch.randn(2, 64, 4).transpose(1, 2)),          # head_dim not unit-stride
    dict(block_tables=torch.zeros(2, 3, dtype=torch.int64)),    # int64 table
    dict(block_tables=torch.zeros(3, 3, dtype=torch.int32)),    # batch mismatch
    dict(context_lens=torch.tensor([20, 5])),                   # int64 lengths
    dict(context_lens=torch.tensor([20, 500], dtype=torch.int32)),  # past the table's capacity
    dict(kv_cache=torch.zeros(4, 2, 16, 2, 128).transpose(3, 4)),   # non-contiguous cache
    dict(kv_cache=torch.zeros(4, 3, 16, 2, 64)),                # not K/V in dim 1
    dict(scale=0.0),
    dict(window=0),
    dict(window=2.5),
], ids=lambda c: "-".join(c))
def test_decode_rejects_bad_arguments(change, monkeypatch):
    monkeypatch.setenv("PDSERVE_USE_TRITON", "0")
    with pytest.raises(kernels.KernelArgumentError):
        kernels.paged_decode_attention(**_decode_args(**change))


def test_decode_attention_planned_once_serves_every_layer(path):
    """One plan (tables checked once) over several layers' caches equals the one-call wrapper
    on each; a layer's cache of another shape, or a query of another batch, is refused."""
    lens = [37, 5, 90]
    layers = [synthetic.random_paged_batch(lens, 3, 64, 16) for _ in range(3)]
    tables, context_lens = layers[0].block_tables, layers[0].context_lens
    plan = kernels.DecodeAttention(layers[0].kv_cache, tables, context_lens, 0.125, window=None)
    for layer in layers:
        query = synthetic.random_queries(len(lens), 9, 64)
        close(plan(query, layer.kv_cache),
              kernels.paged_decode_attention(query, layer.kv_cache, tables, context_lens, 0.125))
    query = synthetic.random_queries(len(lens), 9, 64)
    with pytest.raises(kernels.KernelArgumentError, match="planned"):
        plan(query, torch.zeros(4, 2, 16, 3, 64))
    with pytest.raises(kernels.KernelArgumentError, match="sequences"):
        plan(synthetic.random_queries(2, 9, 64), layers[1].kv_cache)


def test_prefill_rejects_inconsistent_query_start_loc(monkeypatch):
    monkeypatch.setenv("PDSERVE_USE_TRITON", "0")
    batch = synthetic.random_paged_batch([20, 5], 2, 64, 16)
    query = synthetic.random_queries(10, 4, 64)
    for starts in ([0, 5, 9], [0, 2, 10], [1, 5, 10]):  # short of T; chunk > context; not from 0
        with pytest.raises(kernels.KernelArgumentError):
            kernels.paged_prefill_attention(query, batch.kv_cache, batch.block_tables,
                                            torch.tensor(starts, dtype=torch.int32), batch.context_lens, 0.1)
    with pytest.raises(kernels.KernelArgumentError):  # B + 1 entries expected
        kernels.paged_prefill_attention(query, batch.kv_cache, batch.block_tables,
                                        torch.tensor([0, 10], dtype=torch.int32), batch.context_lens, 0.1)


# (num_heads, num_kv_heads, head_dim, block_size)
FUSED_CASES = [(9, 3, 64, 16), (4, 2, 96, 8)]


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding as a complex product: (x1 + i x2) (cos + i sin), per head."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: f"h{c[0]}kv{c[1]}d{c[2]}bs{c[3]}")
def test_rope_store_kv_matches_reference(path, case):
    from pdserve.kernels import fused

    num_heads, num_kv_heads, head_dim, block_size = case
    tokens = 7
    cache = torch.randn(5, 2, block_size, num_kv_heads, head_dim)
    expected = cache.clone()
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    angles = torch.randn(tokens, head_dim // 2) * 10
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    slots = torch.tensor([0, block_size + 3, -1, 5 * block_size - 1, 2 * block_size, -1, block_size - 1])
    q = fused.rope_store_kv(qkv, cos, sin, cache, slots, num_heads, num_kv_heads)
    heads = qkv.view(tokens, num_heads + 2 * num_kv_heads, head_dim)
    reference.store_kv(_rotated(heads[:, num_heads:num_heads + num_kv_heads], cos, sin),
                       heads[:, num_heads + num_kv_heads:], expected, slots)
    close(q, _rotated(heads[:, :num_heads], cos, sin))
    assert q.is_contiguous()
    close(cache, expected)
    if path != "triton_interp":  # Triton does not check slot ranges (see kv_store.store_kv)
        with pytest.raises(kernels.KernelArgumentError):
            fused.rope_store_kv(qkv, cos, sin, cache, slots + 5 * block_size, num_heads, num_kv_heads)


@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_reference_and_updates_the_residual(path, with_delta):
    from pdserve.kernels import fused

    h = torch.randn(6, 576) * 3
    delta = torch.randn(6, 576) if with_delta else None
    weight = torch.randn(576)
    summed = h + delta if with_delta else h.clone()
    normed = fused.add_rms_norm(h, delta, weight, 1e-5)
    close(h, summed)  # the residual stream, updated in place
    close(normed, torch.nn.functional.rms_norm(summed, (576,), weight, 1e-5))


def test_store_kv_rejects_bad_arguments(monkeypatch):
    monkeypatch.setenv("PDSERVE_USE_TRITON", "0")
    cache = torch.zeros(2, 2, 16, 2, 64)
    key = torch.randn(3, 2, 64)
    ok = torch.tensor([0, 1, 2])
    with pytest.raises(kernels.KernelArgumentError):
        kernels.store_kv(key, key, cache, ok.int())  # int32 slots
    with pytest.raises(kernels.KernelArgumentError):
        kernels.store_kv(key, key[:2], cache, ok)  # value shape
    with pytest.raises(kernels.KernelArgumentError):
        kernels.store_kv(key.to(torch.bfloat16), key.to(torch.bfloat16), cache, ok)  # dtype
    with pytest.raises(kernels.KernelArgumentError):
        kernels.store_kv(key, key, cache, torch.tensor([0, 1, 32]))  # slot out of range
    with pytest.raises(kernels.KernelArgumentError):
        kernels.store_kv(key, key, cache, torch.tensor([0, -2, 3]))
    wide = torch.randn(3, 2, 128)[:, :, ::2]  # head_dim strided
    with pytest.raises(kernels.KernelArgumentError):
        kernels.store_kv(wide, wide, cache, ok)
    assert not cache.any()


def test_block_moves_reject_bad_arguments(monkeypatch):
    monkeypatch.setenv("PDSERVE_USE_TRITON", "0")
    layers = [torch.zeros(4, 2, 16, 2, 64) for _ in range(2)]
    buffer = torch.ones(2, 2, 2, 16, 2, 64)
    bad = [
        lambda: kernels.gather_blocks([], torch.tensor([0])),
        lambda: kernels.gather_blocks(layers, torch.tensor([0, 4])),             # out of range
        lambda: kernels.gather_blocks(layers, torch.tensor([-1])),
        lambda: kernels.gather_blocks(layers, torch.tensor([0], dtype=torch.int32)),
        lambda: kernels.gather_blocks(layers + [torch.zeros(4, 2, 16, 2, 32)], torch.tensor([0])),
        lambda: kernels.gather_blocks(layers, torch.tensor([0]), out=torch.empty(1, 2, 2, 16, 2, 32)),
        lambda: kernels.scatter_blocks(buffer, layers, torch.tensor([1, 1])),    # duplicate
        lambda: kernels.scatter_blocks(buffer, layers, torch.tensor([1, 2, 3])),  # buffer too small
        lambda: kernels.scatter_blocks(buffer.to(torch.bfloat16), layers, torch.tensor([1, 2])),
    ]
    for call in bad:
        with pytest.raises(kernels.KernelArgumentError):
            call()
    assert not any(t.any() for t in layers)


# --- dispatch ----------------------------------------------------------------------------

def test_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv("PDSERVE_USE_TRITON", "sometimes")
    with pytest.raises(ValueError, match="PDSERVE_USE_TRITON"):
        kernels.paged_decode_attention(**_decode_args())


@pytest.mark.skipif(INTERPRETED, reason="the interpreter is on in this process")
def test_forcing_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("PDSERVE_USE_TRITON", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET|not installed"):
        kernels.paged_decode_attention(**_decode_args())


def _child_env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PDSERVE_USE_TRITON")}
    env.update(overrides)
    return env


def test_cpu_path_never_imports_triton():
    code = (
        "import sys, torch\n"
        "from pdserve import kernels\n"
        "from pdserve.kernels import synthetic\n"
        "b = synthetic.random_paged_batch([20, 5], 2, 64, 16)\n"
        "q = synthetic.random_queries(2, 4, 64)\n"
        "kernels.paged_decode_attention(q, b.kv_cache, b.block_tables, b.context_lens, 0.1)\n"
        "kernels.gather_blocks([b.kv_cache], torch.tensor([0]))\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    env = _child_env(PDSERVE_USE_TRITON="auto", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.skipif(INTERPRETED, reason="already inside the interpreter run")
@pytest.mark.skipif(not triton_installed(), reason="triton is not installed")
def test_triton_kernels_under_interpreter():
    """Every Triton kernel vs its reference, in a child process with TRITON_INTERPRET=1."""
    env = _child_env(TRITON_INTERPRET="1", OMP_NUM_THREADS="2")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton_interp",
           str(Path(__file__).resolve())]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-2000:]


@pytest.mark.skipif(not triton_installed(), reason="triton is not installed")
def test_triton_kernels_compile_for_h100_without_a_gpu():
    """The GPU compiler rejects code the interpreter runs (tl.dot shapes, dtypes, shared
    memory): compile each kernel for sm_90 with triton's bundled ptxas, in a child process
    without the interpreter."""
    env = _child_env(OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pdserve.kernels.triton_aot", "--arch", "90"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    compiled = [line.split(":")[0] for line in proc.stdout.splitlines() if " ok in " in line]
    assert {"_decode_kernel", "_decode_reduce_kernel", "_prefill_kernel", "_store_kv_kernel",
            "_gather_layer_kernel", "_scatter_layer_kernel", "_nh16_kernel"} <= set(compiled), proc.stdout


# -- the payload digest (kernels.digest) ----------------------------------------------------------
def _digest_payloads() -> list[bytes]:
    from pdserve.kernels.digest import PAIRS

    g = torch.Generator().manual_seed(11)
    sized = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()
             for n in (4, 4 * PAIRS, 4 * PAIRS * 3 + 8)]
    return sized + [b"\xff" * (4 * PAIRS + 4)]  # every half at its largest: no overflow, no sign


@pytest.mark.parametrize("case", range(4), ids=lambda i: f"digest{i}")
def test_payload_digest_matches_reference(path, case):
    from pdserve.kernels import digest

    data = _digest_payloads()[case]
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    got = digest.payload_digest(tensor, digest.digest_key(b"secret"))
    assert got.shape == (digest.num_chunks(len(data)), digest.LANES)
    assert got.tolist() == digest.reference_digest(data, b"secret")


def test_payload_digest_sees_every_bit_and_depends_on_the_key():
    from pdserve.kernels import digest

    data = bytearray(_digest_payloads()[2])
    key = digest.digest_key(b"k")
    base = digest.payload_digest(torch.frombuffer(bytearray(data), dtype=torch.uint8), key)
    for position in (0, 1, 2, 3, len(data) // 2, len(data) - 1):
        for bit in (0, 7):
            altered = bytearray(data)
            altered[position] ^= 1 << bit
            assert not torch.equal(digest.payload_digest(torch.frombuffer(altered, dtype=torch.uint8), key), base)
    other = digest.payload_digest(torch.frombuffer(bytearray(data), dtype=torch.uint8), digest.digest_key(b"k2"))
    assert not torch.equal(other, base)
    with pytest.raises(ValueError, match="32-bit words"):
        digest.payload_digest(torch.zeros(6, dtype=torch.uint8), key)


def test_keyed_digest_is_the_digest_of_the_digest_under_a_second_key():
    from pdserve.kernels import digest

    data = torch.randint(0, 256, (300 * 16384,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    first = digest.payload_digest(data, digest.digest_key(b"s\x00"))
    second = digest.payload_digest(first, digest.digest_key(b"s\x01"))
    got = digest.keyed_digest(data, b"s")
    assert got == second.numpy().tobytes() and len(got) == 2 * 64  # 300 rows of 64 B: two chunks
    assert digest.keyed_digest(data, b"s", cache_key=True) == got
    data[123456] ^= 1
    assert digest.keyed_digest(data, b"s") != got

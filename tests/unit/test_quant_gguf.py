"""GGUF blocks served as they are (`kernels.quant`, `csrc/cpu_quant_gemm.cpp`): each native
type's matmul against gguf-py's dequantize-then-float32 on random blocks, in both CPU paths
this machine has (AVX-512 where present, AVX2 always on x86), and the fast mode's kernels
(bfloat16 with AVX-512 BF16, torch's int4 pack elsewhere).

Tolerances: the expanded weights are exact (d and m are half floats, q at most 8 bits), so the
exact mode differs from float64 over the dequantized weights by float32 summation only
(observed ~4e-7 of the largest output); bf16 activations (fast mode) ~1e-2.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.kernels import cpu_native, quant

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

TYPES = {"Q4_0": quant.Q4_0, "Q4_1": quant.Q4_1, "Q8_0": quant.Q8_0}
REPO = Path(__file__).resolve().parents[2]


def random_weight(qtype: int, n: int, k: int, seed: int = 0) -> tuple[quant.QuantWeight, torch.Tensor]:
    rng = np.random.default_rng(seed)
    blocks = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    return quant.QuantWeight(torch.from_numpy(blocks), qtype), torch.from_numpy(dequantize(blocks, qtype))


@pytest.mark.parametrize("name", TYPES)
def test_blocks_expand_to_exactly_the_dequantized_weights(name):
    weight, reference = random_weight(TYPES[name], 70, 96)
    assert torch.equal(weight.dequantize(), reference)
    assert (weight.out_features, weight.in_features, weight.type_name) == (70, 96, name)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17, 31, 32, 100])  # 1-2 rows, tiles, remainders, the GEMM path
def test_matmul_matches_dequantize_then_float32(name, rows):
    weight, reference = random_weight(TYPES[name], 94, 160, seed=rows)  # odd pairs of rows, 5 blocks
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(94)
    expected = x.double() @ reference.double().T + bias.double()
    got = quant.quant_linear(x, weight, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, 94)
    assert (got.double() - expected).abs().max() <= 2e-6 * expected.abs().max()


@pytest.mark.parametrize("rows", [1, 8, 9, 20])
def test_long_rows(rows):
    """Rows of 65 blocks (a 1B model's are 64 to 256): one and two weight rows per tile."""
    weight, reference = random_weight(quant.Q4_1, 34, 65 * 32, seed=rows)
    x = torch.randn(rows, 65 * 32, generator=torch.Generator().manual_seed(rows))
    expected = x.double() @ reference.double().T
    got = quant.quant_linear(x, weight)
    assert (got.double() - expected).abs().max() <= 2e-6 * expected.abs().max()


@pytest.mark.parametrize("name", TYPES)
def test_prompt_sized_batches_expand_in_tiles(name, monkeypatch):
    """From GEMM_ROWS rows the weights are expanded (into one reused buffer, at most
    EXPAND_BYTES at a time: here 10 rows a tile, so 34 rows take four) for oneDNN's GEMM."""
    monkeypatch.setattr(quant, "EXPAND_BYTES", 10 * 64 * 4)
    weight, reference = random_weight(TYPES[name], 34, 64, seed=5)
    bias = torch.randn(34)
    for rows in (quant.GEMM_ROWS, 70):
        x = torch.randn(rows, 64)
        expected = x.double() @ reference.double().T + bias.double()
        got = quant.quant_linear(x, weight, bias)
        assert (got.double() - expected).abs().max() <= 2e-6 * expected.abs().max()


def test_leading_dimensions_and_strided_input():
    weight, reference = random_weight(quant.Q4_1, 32, 64)
    x = torch.randn(2, 3, 128)[..., ::2]  # not contiguous
    got = quant.quant_linear(x, weight)
    torch.testing.assert_close(got, x @ reference.T, atol=1e-5, rtol=1e-5)


def test_bad_blocks_are_refused():
    with pytest.raises(ValueError, match="no native kernel"):
        quant.QuantWeight(torch.zeros(4, 210, dtype=torch.uint8), 14)  # Q6_K
    with pytest.raises(ValueError, match="whole Q4_1 blocks"):
        quant.QuantWeight(torch.zeros(4, 21, dtype=torch.uint8), quant.Q4_1)
    weight, _ = random_weight(quant.Q8_0, 8, 64)
    with pytest.raises(RuntimeError, match="x must be"):
        quant.quant_linear(torch.randn(2, 32), weight)


def test_stack_joins_rows_of_one_type_only():
    a, ra = random_weight(quant.Q4_1, 8, 64, seed=1)
    b, rb = random_weight(quant.Q4_1, 4, 64, seed=2)
    assert torch.equal(quant.QuantWeight.stack([a, b]).dequantize(), torch.cat([ra, rb]))
    assert quant.QuantWeight.stack([a, random_weight(quant.Q8_0, 4, 64)[0]]) is None


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1"])
def test_fast_mode_int4_pack_is_close(name):
    weight, reference = random_weight(TYPES[name], 64, 256)
    x = torch.randn(5, 256)
    expected = x @ reference.T
    got = quant.Int4Pack(weight)(x)
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17, 31, 40])  # int4 at 1-2, tiles, remainders, prompts
def test_fast_linear_is_close_and_built_for_this_cpu(name, rows):
    """The fast mode's linear at each row count, whichever kernels this build gives it (torch's
    int4 GEMM, the bfloat16 kernel with AVX-512 BF16), within bfloat16's rounding; rows the
    int4 pack cannot hold take the bfloat16 kernel or run exact; Q8_0 stays exact."""
    for out_features in (96, 94):  # 94: not the int4 pack's tiles
        weight, reference = random_weight(TYPES[name], out_features, 160, seed=rows)
        fast = quant.FastLinear.build(weight)
        assert (fast is None) == (name == "Q8_0" or (out_features == 94 and not quant.bf16_kernel_available()))
        if fast is None:
            continue
        assert (fast.int4 is None) == (out_features == 94)
        x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
        bias = torch.randn(out_features)
        expected = x @ reference.T + bias
        got = fast(x, bias)
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        assert (got - expected).abs().max() <= 1e-2 * expected.abs().max()


@pytest.mark.skipif(not quant.bf16_kernel_available(), reason="this CPU has no AVX-512 BF16")
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [2, 5, 8, 9, 16, 31])
def test_bf16_kernel_is_the_bf16_product_in_float32(name, rows):
    """The native bfloat16 kernel (every type it takes): each weight d * q + m rounded once
    to bfloat16, products summed in float32, so it equals the bfloat16 operands' product in
    float64 up to float32 summation order."""
    weight, reference = random_weight(TYPES[name], 94, 160, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows)).bfloat16()
    expected = x.double() @ reference.bfloat16().double().T
    got = cpu_native.quant_module().quant_linear_bf16(x, weight.blocks, weight.qtype, None)
    assert (got.double() - expected).abs().max() <= 2e-6 * expected.abs().max()


@pytest.mark.skipif(not quant.bf16_kernel_available(), reason="this CPU has no AVX-512 BF16")
@pytest.mark.parametrize("name", TYPES)
def test_blocks_expand_to_bf16_as_their_float32_weights_round(name):
    """The fast mode's prompts expand blocks straight to bfloat16: the float32 weights each
    rounded once, bit for bit (so prompts multiply the same numbers as before)."""
    weight, reference = random_weight(TYPES[name], 70, 96)
    out = torch.empty(50, 96, dtype=torch.bfloat16)
    cpu_native.quant_module().dequantize_rows_into(weight.blocks, weight.qtype, 20, out)
    assert torch.equal(out, reference[20:].bfloat16())


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_avx2_path_in_a_child_process():
    """PDSERVE_CPU_ISA=avx2 builds the native kernels without AVX-512 (their own build dir):
    this file's matmul cases and the decode attention cases run again in that build."""
    if "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX2")
    env = {**os.environ, "PDSERVE_CPU_ISA": "avx2", "PDSERVE_CPU_ATTENTION": "native"}
    tests = [f"{__file__}::test_matmul_matches_dequantize_then_float32",
             f"{__file__}::test_fast_linear_is_close_and_built_for_this_cpu",
             f"{__file__}::test_blocks_expand_to_exactly_the_dequantized_weights",
             str(REPO / "tests/unit/test_kernels.py") + "::test_decode_matches_reference"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                           "not torch and not triton", *tests], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_avx2_build_has_no_avx512(monkeypatch):
    from pdserve.kernels import cpu_native

    monkeypatch.setenv("PDSERVE_CPU_ISA", "avx2")
    assert "-mno-avx512f" in cpu_native._flags()
    monkeypatch.setenv("PDSERVE_CPU_ISA", "sse")
    with pytest.raises(ValueError, match="PDSERVE_CPU_ISA"):
        cpu_native._flags()

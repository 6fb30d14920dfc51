"""Integer-dot GGUF kernels (`kernels.int8_dot`, `csrc/cpu_int8_dot.cpp`) on every
instruction-set path this CPU runs, the lower ones forced: each against float64 over the
dequantized weights and the dequantized 8-bit activations (the integer sums are exact, so
only float32 scale products and their order differ: tolerance 1e-5 of the largest output),
against the scalar C path, and against the float32 activations (8-bit blocks: each activation
within half a step of its block's scale; a dot product of random rows stays within 2% of the
largest output, 1e-4 with 16-bit blocks).
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pdserve.kernels import int8_dot, quant

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

TYPES = {"Q4_0": quant.Q4_0, "Q4_1": quant.Q4_1, "Q8_0": quant.Q8_0}
CASES = [(name, bits) for name in TYPES for bits in (8, 16)]  # (type, activation bits)
SUPPORTED = int8_dot.supported_isas()


def random_weight(qtype: int, n: int, k: int, seed: int = 0) -> tuple[quant.QuantWeight, torch.Tensor]:
    rng = np.random.default_rng(seed)
    blocks = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    return quant.QuantWeight(torch.from_numpy(blocks), qtype), torch.from_numpy(dequantize(blocks, qtype))


def each_isa():
    return [pytest.param(isa, marks=pytest.mark.skipif(isa not in SUPPORTED, reason=f"this CPU lacks {isa}"))
            for isa in int8_dot.ISAS]


@pytest.mark.parametrize("bits, dtype, levels", [(8, torch.int8, 127), (16, torch.int16, 32767)])
def test_activations_are_blocks_of_8_or_16_bits(bits, dtype, levels):
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(bits)) * torch.tensor([1e-3, 1.0, 40.0]).unsqueeze(1)
    x[1, 32:64] = 0.0  # an all-zero block
    acts = int8_dot.quantize_activations(x, bits)
    assert acts.q.dtype == dtype and acts.q.shape == (3, 128) and acts.scales.shape == (3, 4)
    q = acts.q.view(3, 4, 32).int()
    assert q.abs().max() <= levels
    assert torch.equal(acts.sums, q.sum(-1).float())
    assert acts.scales[1, 1] == 0 and not q[1, 1].any()
    nonzero = acts.scales > 0
    assert torch.equal(q.abs().amax(-1)[nonzero], torch.full((int(nonzero.sum()),), levels, dtype=torch.int32))
    # half a step, and the float32 rounding of levels / amax against amax / levels: up to
    # about levels * 2^-23 of a step (0.004 of one at 16 bits, where 0.0001 failed on a draw)
    step = acts.scales.unsqueeze(-1)
    margin = 0.5 + levels * 2.0 ** -22
    assert ((acts.dequantize().view(3, 4, 32) - x.view(3, 4, 32)).abs() <= step * margin + 1e-12).all()


@pytest.mark.parametrize("isa", each_isa())
@pytest.mark.parametrize("bits", [8, 16])
def test_every_path_quantizes_alike(isa, bits):
    """The vector quantizer (AVX2) and the scalar one round the same products the same way."""
    x = torch.randn(5, 4096, generator=torch.Generator().manual_seed(bits)) * 3
    x[0, :64] = torch.arange(64) - 31.5  # a ramp: many products near a rounding boundary
    got, want = int8_dot.quantize_activations(x, bits, isa=isa), int8_dot.quantize_activations(x, bits, isa="scalar")
    assert torch.equal(got.q, want.q) and torch.equal(got.scales, want.scales) and torch.equal(got.sums, want.sums)


@pytest.mark.parametrize("isa", each_isa())
@pytest.mark.parametrize("name, bits", CASES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 31])  # tiles of 4 rows and their remainders
def test_each_path_matches_float64_over_the_quantized_activations(isa, name, bits, rows):
    weight, reference = random_weight(TYPES[name], 94, 160, seed=rows)  # pairs of rows, 5 blocks
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(94)
    acts = int8_dot.quantize_activations(x, bits)
    expected = acts.dequantize().double() @ reference.double().T + bias.double()
    got = int8_dot.int8dot_linear(acts, weight, bias, isa=isa)
    assert got.dtype == torch.float32 and got.shape == (rows, 94)
    assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    scalar = int8_dot.int8dot_linear(acts, weight, bias, isa="scalar")
    assert (got - scalar).abs().max() <= 1e-5 * scalar.abs().max()
    exact = x.double() @ reference.double().T + bias.double()
    assert (got.double() - exact).abs().max() <= (2e-2 if bits == 8 else 1e-4) * exact.abs().max()


@pytest.mark.parametrize("isa", each_isa())
@pytest.mark.parametrize("name, bits", CASES)
def test_odd_rows_and_long_rows(isa, name, bits):
    """An odd number of weight rows (one-row tiles) and rows of 65 blocks (a 1B model's are 64-256)."""
    weight, reference = random_weight(TYPES[name], 33, 65 * 32, seed=3)
    acts = int8_dot.quantize_activations(torch.randn(6, 65 * 32, generator=torch.Generator().manual_seed(3)), bits)
    expected = acts.dequantize().double() @ reference.double().T
    got = int8_dot.int8dot_linear(acts, weight, isa=isa)
    assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("isa", [p for p in each_isa() if p.values[0] != "scalar"])
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("n, k", [(94, 160), (33, 65 * 32), (16, 32), (960, 576)])  # partial and whole groups
def test_packed_rows_match_float64_and_the_unpacked_path(isa, name, n, k):
    """pack_rows + packed_linear (one call: 8-bit blocks, 16-bit for Q8_0, then 16 rows a
    vector) against float64 over the same quantized activations, for 1-31 rows (tiles of 4
    and remainders)."""
    bits = int8_dot.PACKED_BITS[TYPES[name]]
    weight, reference = random_weight(TYPES[name], n, k, seed=n)
    packed = int8_dot.pack_rows(weight)
    assert packed.numel() == -(-n // 16) * 16 * weight.blocks.shape[1]  # the blocks' bytes, rows padded to 16
    for rows in (1, 2, 3, 4, 5, 9, 31):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        bias = torch.randn(n)
        acts = int8_dot.quantize_activations(x, bits)
        expected = acts.dequantize().double() @ reference.double().T + bias.double()
        got = int8_dot.packed_linear(x, packed, weight, bias, isa=isa)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
        unpacked = int8_dot.int8dot_linear(acts, weight, bias, isa="scalar")
        assert (got - unpacked).abs().max() <= 1e-5 * unpacked.abs().max()


def test_what_packs():
    assert int8_dot.packs(quant.Q4_1, 8, "avx512vnni") and int8_dot.packs(quant.Q4_0, 8, "avx512vnni")
    assert int8_dot.packs(quant.Q8_0, 16, "avx512vnni") and not int8_dot.packs(quant.Q4_1, 16, "avx512vnni")
    assert int8_dot.packs(quant.Q4_1, 8, "avx2") and int8_dot.packs(quant.Q8_0, 16, "avxvnni")
    assert not int8_dot.packs(quant.Q4_1, 8, "scalar") and not int8_dot.packs(quant.Q8_0, 8, "avx2")
    weight, _ = random_weight(quant.Q4_1, 32, 64)
    assert int8_dot.Int8DotLinear.build(weight, "gguf-int16dot").packed is None  # 16-bit 4-bit calls do not pack


def test_the_linear_runs_prompts_exact_and_decode_rows_as_integers():
    weight, _ = random_weight(quant.Q4_1, 64, 96)
    linear = int8_dot.Int8DotLinear.build(weight, "gguf-int8dot")
    prompt = torch.randn(40, 96)
    assert torch.equal(linear(prompt), quant.quant_linear(prompt, weight))
    rows = torch.randn(3, 192)[:, ::2]  # decode rows, not contiguous
    if linear.packed is not None:
        assert torch.equal(linear(rows), int8_dot.packed_linear(rows.contiguous(), linear.packed, weight))
    step = torch.randn(2, 3, 96)
    if int8_dot.packs(quant.Q4_1, 8):  # AVX-512 VNNI: the packed layout, quantizing in the same call
        assert linear.packed is not None
        expected = int8_dot.packed_linear(step.reshape(6, 96), linear.packed, weight)
    else:
        assert linear.packed is None
        expected = int8_dot.int8dot_linear(int8_dot.quantize_activations(step.reshape(6, 96)), weight)
    assert torch.equal(linear(step), expected.reshape(2, 3, 64))
    head, _ = random_weight(quant.Q8_0, 64, 96)  # Q8_0 takes 16-bit activations
    linear = int8_dot.Int8DotLinear.build(head)
    if int8_dot.packs(quant.Q8_0, 16):
        expected = int8_dot.packed_linear(step.reshape(6, 96), linear.packed, head)
    else:
        expected = int8_dot.int8dot_linear(int8_dot.quantize_activations(step.reshape(6, 96), 16), head)
    assert torch.equal(linear(step), expected.reshape(2, 3, 64))


def test_choosing_a_path():
    assert int8_dot.choose_isa("native", ("scalar", "avx2", "avxvnni")) == "avxvnni"
    assert int8_dot.choose_isa("avx2", ("scalar", "avx2", "avx512vnni")) == "avx2"
    with pytest.raises(ValueError, match="runs only scalar, avx2"):
        int8_dot.choose_isa("avx512vnni", ("scalar", "avx2"))
    assert int8_dot.chosen_isa() in SUPPORTED and SUPPORTED[0] == "scalar"


def test_the_environment_forces_a_lower_path():
    script = "from pdserve.kernels import int8_dot; print(int8_dot.chosen_isa())"
    env = {**os.environ, "PDSERVE_CPU_ISA": "scalar"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "scalar"


def test_bad_input_is_a_clear_error():
    weight, _ = random_weight(quant.Q8_0, 4, 64)
    acts = int8_dot.quantize_activations(torch.randn(2, 64))
    with pytest.raises(RuntimeError, match="int8"):
        int8_dot.int8dot_linear(int8_dot.Int8Activations(acts.q.float(), acts.scales, acts.sums), weight)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        int8_dot.quantize_activations(torch.randn(2, 40))
    with pytest.raises(RuntimeError, match="8 or 16 bits"):
        int8_dot.quantize_activations(torch.randn(2, 64), 4)

    with pytest.raises(RuntimeError, match="only Q4_0, Q4_1 and Q8_0 blocks pack"):
        cpu = __import__("pdserve.kernels.cpu_native", fromlist=["x"]).int8_dot_module()
        cpu.pack_rows(weight.blocks, 6)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        __import__("pdserve.kernels.cpu_native", fromlist=["x"]).int8_dot_module().packed_linear(
            torch.randn(2, 40), torch.zeros(1, 288, dtype=torch.uint8), quant.Q4_0, 4, None, 1)
    with pytest.raises(RuntimeError, match="not a vector path"):
        __import__("pdserve.kernels.cpu_native", fromlist=["x"]).int8_dot_module().packed_linear(
            torch.randn(2, 32), torch.zeros(1, 288, dtype=torch.uint8), quant.Q4_0, 4, None, 0)
    with pytest.raises(RuntimeError, match="not one this CPU runs"):
        cpu = __import__("pdserve.kernels.cpu_native", fromlist=["x"]).int8_dot_module()
        cpu.int8dot_linear(acts.q, acts.scales, acts.sums, weight.blocks, weight.qtype, None, 9)


def test_each_gguf_mode_picks_its_linear():
    weight, _ = random_weight(quant.Q4_1, 32, 64)
    assert quant.mode_linear(weight, "gguf-int8dot").bits == 8
    assert quant.mode_linear(weight, "gguf-int16dot").bits == 16
    head, _ = random_weight(quant.Q8_0, 32, 64)
    assert quant.mode_linear(head, "gguf-int8dot").bits == 16  # the output projection's logits
    assert quant.mode_linear(weight, "gguf") is None  # the exact kernel
    with pytest.raises(ValueError, match="unknown GGUF mode"):
        quant.mode_linear(weight, "gguf-int4")

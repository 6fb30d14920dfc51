"""The native batched LoRA op (`csrc/cpu_lora.cpp` through `kernels.lora.add_lora_native`)
against the row-by-row float64 reference: mixed slots, rows with no adapter left bit for bit,
ranks under the stacks' R (the padding past a slot's rank is never read), slots not adapted
here (rank 0), strided rows, and every instruction-set build this CPU runs (AVX-512 here,
AVX2 in a child process with PDSERVE_CPU_ISA=avx2, its own build; the kernels' scalar
lanes are what a CPU with neither compiles, not a build this machine makes).

Tolerance, against the float64 reference rounded to float32: 1e-5.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.kernels import cpu_native
from pdserve.kernels.checks import KernelArgumentError
from pdserve.kernels.lora import add_lora_native, reference_add_lora, transposed_slices

TOL = dict(atol=1e-5, rtol=1e-5)
CHILD = "PDSERVE_TEST_LORA_ISA_CHILD"


@pytest.fixture(scope="module")
def op():
    found = cpu_native.lora_op()
    if found is None:
        pytest.skip("the native CPU kernels did not build here")
    return found


def _case(slots: list[int], widths, fan_in: int, rank: int, ranks: list[int], seed: int = 0):
    """Stacks with R = `rank`; slot s uses its first ranks[s] rows. The padding past each
    slot's rank holds garbage in what the op reads and zeros in what the reference reads."""
    g = torch.Generator().manual_seed(seed)
    num_slots, t = len(ranks), len(slots)
    x = torch.randn(t, fan_in, generator=g)
    y = torch.randn(t, sum(widths), generator=g)
    a = torch.randn(num_slots, len(widths) * rank, fan_in, generator=g) * 0.15
    bs = [torch.randn(num_slots, w, rank, generator=g) * 0.3 for w in widths]
    a_ref, bs_ref = a.clone(), [b.clone() for b in bs]
    for s, r in enumerate(ranks):
        for i in range(len(widths)):
            a_ref[s, i * rank + r:(i + 1) * rank] = 0
            bs_ref[i][s, :, r:] = 0
    ref_slots = torch.tensor([s if s >= 0 and ranks[s] else -1 for s in slots], dtype=torch.int32)
    expected = reference_add_lora(y, x, a_ref, bs_ref, ref_slots)
    bounds = [sum(widths[:i]) for i in range(len(widths) + 1)]
    native = (x, torch.tensor(slots, dtype=torch.int32), torch.tensor(ranks, dtype=torch.int32), a,
              transposed_slices(bs), bounds)
    return y, native, expected


SLOTS = {
    "decode_mix": [-1, -1, 0, 0, 1, 1, 2, 2],
    "interleaved": [0, 1, 0, 1, -1, 2, 2, 0, -1, 1, 1],
    "one_slot_long": [1] * 37,
    "prefill_runs": [-1] * 5 + [0] * 130 + [2] * 9 + [-1] * 3,
    "single_row": [2],
    "no_adapter": [-1, -1, -1],
}
SHAPES = {  # (widths, fan_in): qkv-like, one slice, gate_up-like, lane tails everywhere
    "qkv": ((64, 16, 16), 64), "one": ((30,), 40), "gate_up": ((100, 100), 130), "wide": ((320,), 17)}


@pytest.mark.parametrize("rank,ranks", [(16, [16, 16, 16]), (16, [4, 16, 1]), (3, [3, 2, 3]), (8, [8, 0, 5])],
                         ids=["full", "mixed_ranks", "odd_rank", "one_not_adapted"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("case", sorted(SLOTS))
def test_matches_reference(op, case, shape, rank, ranks):
    widths, fan_in = SHAPES[shape]
    y, (x, slots, ranks_t, a, bt, bounds), expected = _case(SLOTS[case], widths, fan_in, rank, ranks)
    before = y.clone()
    out = add_lora_native(op, y, x, slots, ranks_t, a, bt, bounds)
    assert out is y
    torch.testing.assert_close(y, expected, **TOL)
    untouched = [t for t, s in enumerate(SLOTS[case]) if s < 0 or ranks[s] == 0]
    assert torch.equal(y[untouched], before[untouched])  # base rows: bit for bit


def test_strided_rows(op):
    """y may be a column slice of a wider tensor and x a row-strided view."""
    slots = [0, 1, -1, 1, 0]
    y, (x, s, r, a, bt, bounds), expected = _case(slots, (48,), 24, 4, [4, 2])
    wide_y = torch.zeros(5, 80)
    wide_y[:, 16:64] = y
    wide_x = torch.zeros(5, 40)
    wide_x[:, 8:32] = x
    add_lora_native(op, wide_y[:, 16:64], wide_x[:, 8:32], s, r, a, bt, bounds)
    torch.testing.assert_close(wide_y[:, 16:64], expected, **TOL)
    assert not wide_y[:, :16].any() and not wide_y[:, 64:].any()


def test_threads_agree(op):
    """The op's tasks split over threads: any thread count gives the same numbers."""
    slots = [0] * 40 + [1] * 40 + [-1] * 8
    y, args, expected = _case(slots, (256, 128, 128), 192, 16, [16, 16])
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(add_lora_native(op, y.clone(), *args))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], expected, **TOL)


@pytest.mark.parametrize("bad", ["slot_range", "rank_range", "bounds", "dtype", "a_rows", "slots_dtype"])
def test_bad_arguments_are_refused(op, bad):
    y, (x, slots, ranks, a, bt, bounds), _ = _case([0, 1], (16, 8), 12, 4, [4, 4])
    if bad == "slot_range":
        slots = torch.tensor([0, 2], dtype=torch.int32)
    elif bad == "rank_range":
        ranks = torch.tensor([4, 5], dtype=torch.int32)
    elif bad == "bounds":
        bounds = [0, 16, 20]
    elif bad == "dtype":
        x = x.double()
    elif bad == "a_rows":
        a = a[:, :7].contiguous()
    else:
        slots = slots.long()
    before = y.clone()
    with pytest.raises(KernelArgumentError):
        add_lora_native(op, y, x, slots, ranks, a, bt, bounds)
    assert torch.equal(y, before)


@pytest.mark.skipif(os.environ.get(CHILD) == "1", reason="already the child build")
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_avx2_build_in_a_child_process():
    """PDSERVE_CPU_ISA=avx2 builds the kernels without AVX-512 (its own build dir); this
    file's cases run again against that build."""
    if "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX2")
    env = {**os.environ, "PDSERVE_CPU_ISA": "avx2", "PDSERVE_CPU_ATTENTION": "native", CHILD: "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
                           "-k", "not child_process"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout


def _tiny_config():
    from pdserve.engine.config import ModelConfig

    return ModelConfig(architecture="llama", vocab_size=64, hidden_size=48, intermediate_size=80, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=12, max_position_embeddings=128, rms_norm_eps=1e-5,
                       rope_theta=10000.0)


def _adapter(config, targets, rank: int, layers, seed: int):
    from pdserve.engine.lora.adapter import LoraAdapter, module_shapes

    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    weights = {(layer, m): (torch.randn(rank, shapes[m][0], generator=g) * 0.2,
                            torch.randn(shapes[m][1], rank, generator=g) * 0.2) for layer in layers for m in targets}
    return LoraAdapter(f"a{seed}", "", rank, 2.0 * rank, 2.0, tuple(targets), weights)


@pytest.mark.parametrize("rows", [8, 150])
def test_slot_weights_native_layout_equals_the_torch_path(op, rows):
    """SlotWeights on the native path (bt, per-linear ranks) adds what the torch path adds, for
    adapters of lower rank than the stacks, over some modules and layers only, and after a
    slot is rewritten by an adapter that adapts less than the one before."""
    from pdserve.engine.lora.adapter import TARGET_MODULES, module_shapes
    from pdserve.engine.lora.slots import GROUPS, SlotWeights

    config = _tiny_config()
    cpu = torch.device("cpu")
    paths = {p: SlotWeights(config, 3, 8, cpu, torch.float32, p) for p in ("native", "torch")}
    for weights in paths.values():
        weights.write(0, _adapter(config, TARGET_MODULES, 8, (0, 1), seed=1))
        weights.write(1, _adapter(config, ("q_proj", "v_proj", "down_proj"), 3, (1,), seed=2))
        weights.write(2, _adapter(config, TARGET_MODULES, 8, (0, 1), seed=3))
        weights.write(2, _adapter(config, ("up_proj",), 5, (0,), seed=4))  # rewritten: less than before
    row_slots = sorted(t % 4 - 1 for t in range(rows))
    shapes = module_shapes(config)
    g = torch.Generator().manual_seed(0)
    for layer in range(config.num_layers):
        for group, mods in GROUPS.items():
            x = torch.randn(rows, shapes[mods[0]][0], generator=g)
            y = torch.randn(rows, sum(shapes[m][1] for m in mods), generator=g)
            outs = {p: w.batch(row_slots, cpu).apply(layer, group, x, y.clone()) for p, w in paths.items()}
            torch.testing.assert_close(outs["native"], outs["torch"], **TOL)
            base = [t for t, s in enumerate(row_slots) if s < 0]
            assert torch.equal(outs["native"][base], y[base])

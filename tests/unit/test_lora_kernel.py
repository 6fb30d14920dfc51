"""`kernels.add_lora` against its row-by-row reference: the torch path (grouped by runs of
one slot) here, the Triton kernels under Triton's CPU interpreter in a child process (the
interpreter must be on before triton decorates a kernel), selecting ids with `triton_interp`.

Tolerance, against the float64 reference rounded to the output dtype: fp32 1e-5, bf16 2e-2.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.kernels.checks import KernelArgumentError
from pdserve.kernels.dispatch import interpreting, triton_installed
from pdserve.kernels.lora import add_lora, reference_add_lora, runs

INTERPRETED = interpreting()
PATHS = ["torch", "triton_interp"] if INTERPRETED else ["torch"]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    monkeypatch.setenv("PDSERVE_USE_TRITON", "1" if request.param == "triton_interp" else "0")
    return request.param


def _case(slots: list[int], widths=(48, 16, 16), fan_in=40, num_slots=3, rank=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = len(slots)
    x = torch.randn(t, fan_in, generator=g).to(dtype)
    y = torch.randn(t, sum(widths), generator=g).to(dtype)
    # LoRA-sized factors: the update is of the order of the base output, not far above it
    a = (torch.randn(num_slots, len(widths) * rank, fan_in, generator=g) * 0.15).to(dtype)
    bs = [(torch.randn(num_slots, w, rank, generator=g) * 0.3).to(dtype) for w in widths]
    return y, x, a, bs, torch.tensor(slots, dtype=torch.int32)


SLOTS = {
    "mixed": [0, 0, -1, 2, 1, 1, 1, -1, 0],
    "one_slot": [1] * 7,
    "no_adapter": [-1, -1, -1],
    "single_row": [2],
    "interleaved": [0, 1, 0, 1, -1, 2],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("widths", [(48, 16, 16), (30,), (64, 64)], ids=["qkv", "one", "gate_up"])
@pytest.mark.parametrize("case", sorted(SLOTS))
def test_add_lora_matches_reference(path, case, widths, dtype):
    y, x, a, bs, slots = _case(SLOTS[case], widths, dtype=dtype)
    expected = reference_add_lora(y, x, a, bs, slots)
    out = add_lora(y, x, a, bs, slots, runs(SLOTS[case]))
    assert out is y
    torch.testing.assert_close(y.float(), expected.float(), **TOL[dtype])


def test_strided_output_slice(path):
    """y may be a column slice of a wider tensor (rows strided), x a row-contiguous view."""
    slots = [0, 1, -1, 1]
    y, x, a, bs, s = _case(slots, (16,))
    wide = torch.zeros(4, 40)
    wide[:, 8:24] = y
    expected = reference_add_lora(y, x, a, bs, s)
    add_lora(wide[:, 8:24], x, a, bs, s, runs(slots))
    torch.testing.assert_close(wide[:, 8:24], expected, atol=1e-5, rtol=1e-5)
    assert not wide[:, :8].any() and not wide[:, 24:].any()


def test_runs():
    assert runs([0, 0, -1, 2, 1, 1, -1, 1]) == [(0, 0, 2), (2, 3, 4), (1, 4, 6), (1, 7, 8)]
    assert runs([-1, -1]) == []


@pytest.mark.parametrize("bad", ["x_width", "b_rank", "widths", "slots_dtype", "a_layout"])
def test_bad_arguments_are_refused(bad):
    y, x, a, bs, slots = _case([0, 1])
    if bad == "x_width":
        x = torch.zeros(2, 7)
    elif bad == "b_rank":
        bs = [torch.zeros(3, 48, 5), bs[1], bs[2]]
    elif bad == "widths":
        y = torch.zeros(2, 10)
    elif bad == "slots_dtype":
        slots = slots.long()
    else:
        a = a.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(KernelArgumentError):
        add_lora(y, x, a, bs, slots, [(0, 0, 1), (1, 1, 2)])


@pytest.mark.skipif(INTERPRETED, reason="already inside the interpreter run")
@pytest.mark.skipif(not triton_installed(), reason="triton is not installed")
def test_triton_kernels_under_interpreter():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PDSERVE_USE_TRITON")}
    env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
                           "-k", "triton_interp"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


@pytest.mark.parametrize("widths", [(48, 16, 16), (30,), (64, 64)], ids=["qkv", "one", "gate_up"])
@pytest.mark.parametrize("case", sorted(SLOTS))
def test_dense_path_matches_reference(case, widths):
    """`add_lora_dense` with the block matrix built from the same slices."""
    from pdserve.kernels.lora import add_lora_dense, dense_row_mask

    y, x, a, bs, slots = _case(SLOTS[case], widths)
    num_slots, k, _ = a.shape
    rank = k // len(widths)
    b_full = torch.zeros(num_slots * k, sum(widths))
    for s in range(num_slots):
        off = 0
        for i, b in enumerate(bs):
            b_full[s * k + i * rank:s * k + (i + 1) * rank, off:off + b.shape[1]] = b[s].T
            off += b.shape[1]
    expected = reference_add_lora(y, x, a, bs, slots)
    add_lora_dense(y, x, a, b_full, dense_row_mask(slots, num_slots, k, torch.float32))
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)

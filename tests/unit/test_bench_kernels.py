"""`pdserve bench kernels` on CPU, briefly: it runs, times both decode paths and says how
they compare (the numbers themselves are for the closing notes, not asserted)."""
from __future__ import annotations

import re

import torch

from pdserve.bench import kernels as bench_kernels


def test_cpu_decode_paths_are_timed_side_by_side(capsys):
    previous = torch.get_num_threads()
    try:
        assert bench_kernels.main(["--device", "cpu", "--only-decode", "--iters", "3", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(previous)
    out = capsys.readouterr().out
    assert re.search(r"decode attention \(native path\).* per layer", out), out
    assert re.search(r"decode attention \(torch path\).* per layer", out), out
    assert re.search(r"native path [0-9.]+x the torch path", out), out

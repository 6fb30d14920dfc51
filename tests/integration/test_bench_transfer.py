"""`pdserve bench transfer` between two real processes: each transport measured keyless and
under a transfer key (its `+aead` row, payloads sealed), with the ratio between the two."""
from __future__ import annotations

import pytest

from pdserve.bench import transfer


def test_each_transport_is_measured_in_clear_and_sealed_with_their_ratio():
    pytest.importorskip("ucxx", reason="ucxx-cu12 is not installed")
    cells, skipped = transfer.run(["ucx", "nccl"], [1], repeats=1, progress=False, sealed=True)
    assert not skipped, skipped
    rows = {c.backend: c for c in cells}
    assert {"ucx", "ucx+aead", "nccl", "nccl+aead"} <= set(rows)
    assert all(c.bytes_per_s > 0 and c.cpu_s > 0 for c in cells)
    table = transfer.format_table(cells).splitlines()
    assert table[0].split()[4:6] == ["cpu", "ms"]
    bounds = transfer.sealed_bounds(cells, 2)
    assert [line.split()[0] for line in bounds] == ["ucx+aead", "nccl+aead"]
    at_most = rows["ucx"].seconds / (rows["ucx+aead"].cpu_s / 2)
    assert float(bounds[0].split()[4].rstrip("x")) == pytest.approx(min(1.0, at_most), abs=0.006)
    assert table[0].split()[-2:] == ["x", "clear"]
    sealed = next(line for line in table if line.startswith("ucx+aead"))
    ratio = float(sealed.split()[-1])
    assert ratio == pytest.approx(rows["ucx+aead"].bytes_per_s / rows["ucx"].bytes_per_s, abs=0.006)
    keyless, _ = transfer.run(["ucx"], [1], repeats=1, progress=False)
    assert {c.backend for c in keyless} == {"socket", "memcpy", "ucx"}

"""`bench serve --trace-out` records what `pdserve plan --trace` reads."""
from __future__ import annotations

import pytest

from pdserve.bench.report import BenchRun, RequestResult, Slo, summarize
from pdserve.bench.serve import write_trace_of
from pdserve.planner.workload import TraceRequest, read_trace


def result(index: int, start_s: float, prompt: int | None, output: int, success: bool = True) -> RequestResult:
    return RequestResult(index, "default", success, "" if success else "boom", start_s, 0.1 if success else None,
                         0.5 if success else None, (), output, prompt, prompt is not None, output, "length",
                         100, 16)


def test_trace_out_is_a_plan_trace(tmp_path):
    slo = Slo(2000, 100)
    first = [result(0, 0.0, 120, 16), result(1, 0.5, None, 8), result(2, 0.7, 50, 0, success=False)]
    second = [result(3, 0.25, 90, 4)]
    runs = [BenchRun(summarize("rate=1", "poisson", 1.0, first, 2.0, slo), tuple(first)),
            BenchRun(summarize("rate=2", "poisson", 2.0, second, 1.0, slo), tuple(second))]
    path = write_trace_of(tmp_path / "trace.jsonl", runs)
    assert read_trace(path) == (TraceRequest(0.0, 120, 16), TraceRequest(0.5, 100, 8), TraceRequest(2.25, 90, 4))


def test_plan_check_dry_run_prints_predictions_and_commands(tmp_path, capsys):
    from pdserve.bench.plan_check import main
    from pdserve.planner.profile import Profile, StepCost, TransferCost, save_profile

    profile = Profile(model="m", compat_hash="", device="cpu", source="test",
                      step=StepCost(0.002, 0.0002, 0.0, 0.0005, 1e-6), kv_bytes_per_token=1000, kv_tokens=100_000,
                      transfers=(TransferCost("socket", 1e9, 0.001),))
    path = save_profile(profile, tmp_path / "p.json")
    assert main(["--profile", str(path), "--dry-run", "--rates", "1,4,16", "--run-s", "5", "--cores", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("pdserve up --local-prefill") == 3 and out.count("pdserve up --num-prefill 1 --num-decode 1") == 3
    assert main(["--profile", str(path), "--dry-run", "--run-s", "5", "--cores", "2"]) == 0  # rates from the profile
    assert main(["--profile", str(path), "--dry-run", "--configs", "3p1d"]) == 2


def test_plan_check_report_gives_each_ratio_and_the_count_within_20_percent():
    from pdserve.bench.plan_check import bench_trace, predict, record, report
    from pdserve.bench.serve import arrival_offsets
    from pdserve.planner.profile import Profile, StepCost, TransferCost
    from pdserve.planner.types import Slo as PlanSlo
    import argparse
    import random

    profile = Profile(model="m", compat_hash="", device="cpu", source="test",
                      step=StepCost(0.002, 0.0002, 0.0, 0.0005, 1e-6), kv_bytes_per_token=1000, kv_tokens=100_000,
                      transfers=(TransferCost("socket", 1e9, 0.001),))
    # the simulated arrivals are the very ones bench serve sends in that run
    assert [r.arrival_s for r in bench_trace(2.0, 1, 5, 64, 8, 0)] == arrival_offsets(
        "poisson", 2.0, 5, random.Random("pdserve-arrivals:0:1"))
    slo = PlanSlo(5000, 500)
    pred = predict(profile, "colocated", 2.0, 0, 6, 64, 8, slo, 2, 0)
    results = [result(i, i * 0.5, 64, 8) for i in range(6)]  # TTFT 100 ms, e2e 500 ms each
    run = BenchRun(summarize("rate=2", "poisson", 2.0, results, 3.0, Slo(5000, 500)), tuple(results))
    text = report([("colocated", 2.0, pred, run)], slo)
    lines = text.splitlines()
    assert lines[0].split() == ["config", "rate", "metric", "predicted", "measured", "ratio"]
    assert len([line for line in lines if line.strip().startswith("colocated")]) == 4
    assert any(line.startswith("within 20%: ") and line.endswith(" of 4 predictions") for line in lines)
    ttft_row = next(line.split() for line in lines if "TTFT p50" in line)
    assert float(ttft_row[-1]) == pytest.approx(pred.ms("ttft", 50) / 100.0, abs=0.01)  # predicted / 100 ms
    doc = record([("colocated", 2.0, pred, run)], argparse.Namespace(input_len=64, output_len=8, seed=0,
                                                                      slo_ttft_ms=5000.0, slo_tpot_ms=500.0), 2)
    assert doc["runs"][0]["num_requests"] == 6 and set(doc["runs"][0]["measured_ms"]) == {
        "ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"}

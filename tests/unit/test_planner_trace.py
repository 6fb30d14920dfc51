"""`bench serve --trace-out` records what `pdserve plan --trace` reads."""
from __future__ import annotations

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

"""Unit tests of `pdserve bench`: statistics, workload generation, arrivals, CLI dispatch,
and the disaggregation experiment's plan (dry run) and analysis."""
from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
import sys
import types

import pytest
from pdserve.bench import cli as bench_cli
from pdserve.bench.comparison import SETUPS, compare, judge
from pdserve.bench.experiment import Ports, ServiceOptions, plan_setup
from pdserve.bench.experiment import main as experiment_main
from pdserve.bench.launch import LaunchError, ServiceGroup, ServiceSpec
from pdserve.bench.report import (
    BenchRun,
    LatencyStats,
    RequestResult,
    RunSummary,
    Slo,
    load_summaries,
    percentile,
    summarize,
    summary_from_json,
    to_jsonable,
    tpot,
    write_json,
)
from pdserve.bench.serve import LoadPlan, arrival_offsets
from pdserve.bench.workload import (
    WORDS,
    BenchConfigError,
    RequestClass,
    SyntheticWorkload,
    load_dataset,
    parse_length,
    parse_mix,
)

SLO = Slo(ttft_ms=200.0, tpot_ms=50.0)


def result(index=0, *, ttft=0.1, e2e=1.0, out=10, success=True, prompt=100) -> RequestResult:
    itl = tuple([(e2e - ttft) / (out - 1)] * (out - 1)) if out > 1 else ()
    return RequestResult(index=index, class_name="c", success=success,
                         error="" if success else "HTTP 500: boom", start_s=0.0, ttft_s=ttft,
                         e2e_s=e2e, itl_s=itl, output_tokens=out, prompt_tokens=prompt,
                         usage_reported=True, num_chunks=out, finish_reason="length",
                         target_input_tokens=prompt, max_tokens=out)


# ---------------------------------------------------------------- statistics


def test_percentile_interpolates_like_numpy_default():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile([10, 20], 90) == pytest.approx(19.0)
    assert percentile([7], 99) == 7
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_percentiles_are_ordered_on_random_data():
    rng = random.Random(3)
    for n in (1, 2, 5, 50, 999):
        values = [rng.expovariate(1.0) for _ in range(n)]
        s = LatencyStats.of(values)
        assert s.count == n
        assert min(values) * 1000 <= s.p50_ms <= s.p90_ms <= s.p99_ms <= s.max_ms
        assert s.max_ms == pytest.approx(max(values) * 1000)
        assert s.mean_ms == pytest.approx(statistics.fmean(values) * 1000)
    assert LatencyStats.of([]) == LatencyStats(0, None, None, None, None, None)


def test_tpot_arithmetic():
    assert tpot(e2e_s=1.0, ttft_s=0.1, output_tokens=10) == pytest.approx(0.1)
    assert tpot(e2e_s=0.5, ttft_s=0.5, output_tokens=2) == 0.0
    assert tpot(1.0, 0.1, 1) is None and tpot(1.0, 0.1, 0) is None
    assert result(ttft=0.2, e2e=2.2, out=5).tpot_s == pytest.approx(0.5)
    assert result(success=False).tpot_s is None


def test_slo_judges_ttft_and_tpot_and_single_tokens_on_ttft_only():
    assert SLO.is_met(result(ttft=0.2, e2e=0.2 + 9 * 0.05, out=10))  # both exactly at the SLO
    assert not SLO.is_met(result(ttft=0.21, e2e=0.5, out=10))
    assert not SLO.is_met(result(ttft=0.1, e2e=0.1 + 9 * 0.06, out=10))
    assert SLO.is_met(result(ttft=0.1, e2e=5.0, out=1))  # no TPOT for one token
    assert not SLO.is_met(result(ttft=0.1, e2e=0.2, out=10, success=False))


def test_summary_throughput_goodput_and_failures():
    results = [result(0, ttft=0.1, e2e=0.1 + 9 * 0.01, out=10),  # good
               result(1, ttft=0.5, e2e=1.0, out=10),  # TTFT too slow
               result(2, ttft=0.1, e2e=0.1 + 4 * 0.2, out=5),  # TPOT too slow
               result(3, success=False, out=3)]
    s = summarize("rate=2", "poisson", 2.0, results, duration_s=2.0, slo=SLO)
    assert (s.num_requests, s.num_succeeded, s.num_failed, s.num_good) == (4, 3, 1, 1)
    assert s.request_throughput == pytest.approx(1.5)
    assert s.goodput == pytest.approx(0.5) and s.goodput <= s.request_throughput
    assert s.total_output_tokens == 25 and s.output_throughput == pytest.approx(12.5)
    assert s.total_prompt_tokens == 300 and s.prompt_throughput == pytest.approx(150)
    assert s.ttft.count == s.tpot.count == s.e2e.count == 3
    assert s.itl.count == 9 + 9 + 4
    assert s.tpot.max_ms == pytest.approx(200.0)
    assert s.errors == (("HTTP 500: boom", 1),)


def test_goodput_never_exceeds_throughput_on_random_runs():
    rng = random.Random(11)
    for _ in range(50):
        results = [result(i, ttft=rng.uniform(0, 0.4), e2e=rng.uniform(0.4, 2),
                          out=rng.randint(1, 30), success=rng.random() > 0.2) for i in range(20)]
        s = summarize("r", "poisson", 1.0, results, rng.uniform(1, 10), SLO)
        assert 0 <= s.goodput <= s.request_throughput
        assert s.num_good <= s.num_succeeded <= s.num_requests


def test_summary_json_round_trip_keeps_infinite_rate(tmp_path):
    s = summarize("rate=inf", "poisson", math.inf, [result(0), result(1, success=False)], 1.0, SLO)
    text = json.dumps(to_jsonable(s), allow_nan=False)  # valid JSON: no bare Infinity
    assert summary_from_json(json.loads(text)) == s
    path = write_json(tmp_path / "r.json", {"note": "x"}, [BenchRun(s, (result(0),))])
    assert load_summaries(path) == [s]
    with pytest.raises(ValueError, match="not a run summary"):
        summary_from_json({"label": "x"})


# ---------------------------------------------------------------- workload


@pytest.mark.parametrize("spec,expected", [
    ("128", ("fixed", 128, 128)), ("1000-2000", ("uniform", 1000, 2000)),
    ("normal(300,50)", ("normal", 150, 450)), ("normal(64, 16, 32, 96)", ("normal", 32, 96)),
])
def test_parse_length(spec, expected):
    d = parse_length(spec)
    assert (d.kind, d.low, d.high) == expected
    assert parse_length(str(d)) == d  # str() is a spec that parses back


@pytest.mark.parametrize("spec", ["0", "-5", "10-5", "0-3", "abc", "normal(10)",
                                  "normal(10,2,20,30)", ""])
def test_parse_length_rejects(spec):
    with pytest.raises(BenchConfigError):
        parse_length(spec)


@pytest.mark.parametrize("specs", [[], ["a:1:10"], ["a:0:10:10"], ["a:x:10:10"],
                                   ["a:1:10:10", "a:1:5:5"], [":1:10:10"]])
def test_parse_mix_rejects(specs):
    with pytest.raises(BenchConfigError):
        parse_mix(specs)


def test_length_samples_stay_in_bounds_and_follow_the_distribution():
    rng = random.Random(0)
    uniform = [parse_length("10-20").sample(rng) for _ in range(3000)]
    assert min(uniform) == 10 and max(uniform) == 20
    assert statistics.fmean(uniform) == pytest.approx(15, abs=0.3)
    normal = [parse_length("normal(100,10,90,130)").sample(rng) for _ in range(3000)]
    assert min(normal) >= 90 and max(normal) <= 130
    assert min(normal) == 90  # the clip is hit: mean - 1 std
    assert statistics.median(normal) == pytest.approx(100, abs=1.5)
    assert {parse_length("7").sample(rng) for _ in range(10)} == {7}


def test_synthetic_workload_is_seeded_and_index_addressable():
    classes = parse_mix(["long:1:200-300:16", "chat:3:5-20:normal(8,2)"])
    a = SyntheticWorkload(classes, seed=1).requests(0, 40)
    assert a == SyntheticWorkload(classes, seed=1).requests(0, 40)
    assert a[10:20] == SyntheticWorkload(classes, seed=1).requests(10, 10)
    assert a != SyntheticWorkload(classes, seed=2).requests(0, 40)
    assert len({r.prompt_text() for r in a}) == 40  # no shared prompts
    for r in a:
        words = r.prompt_text().split(" ")
        assert len(words) == r.target_input_tokens and set(words) <= set(WORDS)
        cls = {c.name: c for c in classes}[r.class_name]
        assert cls.input_len.low <= r.target_input_tokens <= cls.input_len.high
        assert cls.output_len.low <= r.max_tokens <= cls.output_len.high
        assert [m.role for m in r.messages] == ["user"]


def test_synthetic_mix_follows_weights():
    classes = (RequestClass("a", 1, parse_length("5"), parse_length("5")),
               RequestClass("b", 3, parse_length("5"), parse_length("5")))
    names = [r.class_name for r in SyntheticWorkload(classes, seed=0).requests(0, 4000)]
    assert names.count("b") / len(names) == pytest.approx(0.75, abs=0.03)


def test_word_list_is_distinct_single_words():
    assert len(WORDS) == len(set(WORDS)) > 400
    assert all(w.isalpha() and w.islower() for w in WORDS)


def test_dataset_loading_and_cycling(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"messages": [{"role": "system", "content": "s"}, '
                    '{"role": "user", "content": "u"}], "max_tokens": 9}\n\n'
                    '{"prompt": "p"}\n')
    w = load_dataset(path, default_max_tokens=4)
    reqs = w.requests(0, 5)
    assert [r.max_tokens for r in reqs] == [9, 4, 9, 4, 9]
    assert reqs[0].prompt_text() == "s\nu" and reqs[1].messages[0].role == "user"
    assert all(r.target_input_tokens is None for r in reqs)
    assert [r.index for r in w.requests(7, 2)] == [7, 8]


@pytest.mark.parametrize("line,message", [
    ("not json", ":1: not JSON"), ("[1]", "expected an object"),
    ('{"messages": []}', "non-empty list"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "role in"),
    ('{"messages": [{"role": "user", "content": 3}]}', "string content"),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    ('{"prompt": "x", "max_tokens": true}', "max_tokens"), ('{"other": 1}', "needs 'messages'"),
])
def test_dataset_rejects_bad_lines_with_their_line_number(tmp_path, line, message):
    path = tmp_path / "d.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(BenchConfigError, match=message) as e:
        load_dataset(path, 4)
    assert f"{path}:1" in str(e.value)


def test_dataset_missing_or_empty(tmp_path):
    with pytest.raises(BenchConfigError, match="dataset"):
        load_dataset(tmp_path / "nope.jsonl", 4)
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(BenchConfigError, match="no requests"):
        load_dataset(tmp_path / "e.jsonl", 4)


# ---------------------------------------------------------------- arrivals


def test_arrival_offsets():
    poisson = arrival_offsets("poisson", 4.0, 4000, random.Random(5))
    assert poisson[0] == 0 and poisson == sorted(poisson)
    gaps = [b - a for a, b in zip(poisson, poisson[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.08)  # exponential: sd == mean
    assert poisson == arrival_offsets("poisson", 4.0, 4000, random.Random(5))
    assert arrival_offsets("fixed", 2.0, 4, random.Random(0)) == [0, 0.5, 1.0, 1.5]
    assert arrival_offsets("poisson", math.inf, 3, random.Random(0)) == [0, 0, 0]


@pytest.mark.parametrize("kwargs", [dict(loads=()), dict(loads=(0,)), dict(loads=(-1,)),
                                    dict(arrival="closed", loads=(1.5,)),
                                    dict(arrival="closed", loads=(math.inf,)),
                                    dict(num_requests=0), dict(duration_s=0),
                                    dict(max_concurrency=0), dict(arrival="burst")])
def test_load_plan_rejects(kwargs):
    with pytest.raises(BenchConfigError):
        LoadPlan(**kwargs)


def test_serve_flags_build_a_validated_plan():
    from pdserve.bench.serve import build_parser, settings_from_args

    def settings(*argv):
        return settings_from_args(build_parser().parse_args(list(argv)))

    s, w = settings("--concurrency", "2,4", "--extra-body", '{"top_k": 5}', "--ignore-eos",
                    "--mix", "a:1:10:5")
    assert (s.plan.arrival, s.plan.loads) == ("closed", (2.0, 4.0))
    assert json.loads(s.endpoint.extra_body_json) == {"top_k": 5, "ignore_eos": True}
    assert isinstance(w, SyntheticWorkload) and w.classes[0].name == "a"
    s, _ = settings("--request-rates", "1,inf", "--arrival", "fixed")
    assert (s.plan.arrival, s.plan.loads, s.endpoint.extra_body_json) == ("fixed", (1.0, math.inf), "{}")
    for bad in (["--request-rates", "1", "--concurrency", "2"], ["--extra-body", "[1]"],
                ["--extra-body", "{x"], ["--base-url", "localhost:8000"], ["--slo-ttft-ms", "0"],
                ["--dataset", "x.jsonl", "--mix", "a:1:1:1"], ["--request-timeout-s", "0"]):
        with pytest.raises(BenchConfigError):
            settings(*bad)


# ---------------------------------------------------------------- CLI dispatch


def test_dispatch_reports_a_missing_benchmark_module(monkeypatch, capsys):
    monkeypatch.setitem(bench_cli.BENCHMARKS, "offline", "no_such_bench_module")
    assert bench_cli.main("offline", []) == 2
    assert "'pdserve bench offline' is not available" in capsys.readouterr().err
    assert bench_cli.main("nonsense", []) == 2


def test_dispatch_calls_the_module_main_with_the_rest(monkeypatch):
    seen = []
    module = types.ModuleType("pdserve.bench.fake_bench")
    module.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "pdserve.bench.fake_bench", module)
    monkeypatch.setitem(bench_cli.BENCHMARKS, "fake", "fake_bench")
    assert bench_cli.main("fake", ("--x", "1")) == 3
    assert seen == [["--x", "1"]]
    assert bench_cli.load("serve").__module__ == "pdserve.bench.serve"


def test_dispatch_does_not_hide_a_missing_dependency(monkeypatch):
    def fail(name, *a, **k):
        raise ModuleNotFoundError("No module named 'somedep'", name="somedep")

    monkeypatch.setattr(bench_cli.importlib, "import_module", fail)
    monkeypatch.setitem(bench_cli.BENCHMARKS, "broken", "broken")
    with pytest.raises(ModuleNotFoundError, match="somedep"):
        bench_cli.load("broken")


# ---------------------------------------------------------------- experiment


def test_experiment_plans_use_only_real_cli_flags_and_pin_cores():
    from pdserve.deploy.cli import build_parser

    opts = ServiceOptions(cores=(4, 5), kv_backends="ucx,disk", decode_args=("--max-batch-size", "8"))
    ports = Ports.pick()
    assert len(set(dataclasses.astuple(ports))) == 7
    disagg, coloc = (plan_setup(name, opts, ports) for name in SETUPS)
    for plan in (disagg, coloc):
        for spec in plan.services:
            build_parser().parse_args(list(spec.args))  # SystemExit on any unknown flag
    roles = {s.name: s for s in disagg.services}
    assert set(roles) == {"router", "prefill", "decode"}
    assert (roles["prefill"].cpus, roles["decode"].cpus, roles["router"].cpus) == ((4,), (5,), ())
    assert roles["prefill"].num_threads == roles["decode"].num_threads == 1
    assert "--max-batch-size" in roles["decode"].args and "ucx,disk" in roles["prefill"].args
    (decode,) = [s for s in coloc.services if s.name == "decode"]
    assert [s.name for s in coloc.services] == ["router", "decode"]
    assert decode.cpus == (4, 5) and decode.num_threads == 2
    assert "taskset -c 4,5" in decode.command_line() and "--num-threads 2" in decode.command_line()


def test_experiment_dry_run_prints_commands_and_starts_nothing(tmp_path, capsys):
    out = tmp_path / "exp"
    rc = experiment_main(["--dry-run", "--cores", "0,1", "--rates", "0.5,1",
                          "--out-dir", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "taskset -c 0 " in text and "taskset -c 1 " in text and "taskset -c 0,1 " in text
    assert text.count("pdserve.deploy.cli router") == 2
    assert "long x1: input 1000-2000, output 128" in text
    assert not out.exists()


def test_experiment_rejects_bad_arguments(capsys):
    assert experiment_main(["--dry-run", "--cores", "1,1"]) == 2
    assert experiment_main(["--dry-run", "--setups", "both"]) == 2
    assert experiment_main(["--dry-run", "--rates", "1,inf"]) == 2
    assert "pdserve bench experiment:" in capsys.readouterr().err


def _summary(rate: float, ttft_p99: float, tpot_p99: float, goodput: float) -> RunSummary:
    stats = lambda p99: LatencyStats(10, p99 / 2, p99 / 2, p99 * 0.9, p99, p99)  # noqa: E731
    return RunSummary(
        label=f"rate={rate:g}", arrival="poisson", load=rate, num_requests=10,
        num_succeeded=10, num_failed=0, duration_s=10.0, request_throughput=1.0,
        output_throughput=50.0, prompt_throughput=500.0, goodput=goodput, num_good=int(goodput * 10),
        total_prompt_tokens=5000, total_output_tokens=500, slo=Slo(2000, 100),
        ttft=stats(ttft_p99), tpot=stats(tpot_p99), itl=stats(tpot_p99), e2e=stats(9000), errors=())


def test_experiment_analysis_ratios_and_targets():
    disagg = [_summary(0.5, 900, 40, 0.5), _summary(1, 1500, 45, 0.9), _summary(2, 2500, 50, 1.2)]
    coloc = [_summary(0.5, 800, 90, 0.4), _summary(1, 1900, 120, 0.5), _summary(2, 6000, 300, 0.1),
             _summary(4, 9000, 900, 0.0)]  # a rate only colocated ran: dropped
    rows = compare(disagg, coloc)
    assert [r.rate for r in rows] == [0.5, 1, 2]
    assert rows[1].tpot_p99_ratio == pytest.approx(120 / 45)
    assert rows[1].ttft_p99_ratio == pytest.approx(1900 / 1500)
    assert rows[2].goodput_ratio == pytest.approx(12.0)
    v = judge(rows, Slo(2000, 100))
    assert v.reference_rate == 1  # highest rate with colocated TTFT p99 <= 2 s
    assert v.tpot_p99_ratio_at_reference == pytest.approx(120 / 45) and v.meets_tpot_target
    assert v.best_goodput_ratio == pytest.approx(1.2 / 0.5) and v.meets_goodput_target

    v = judge(compare([_summary(1, 100, 50, 1.0)], [_summary(1, 3000, 60, 0.0)]), Slo(2000, 100))
    assert v.reference_rate is None and not v.meets_tpot_target
    assert v.best_goodput_ratio == math.inf and v.meets_goodput_target
    v = judge(compare([_summary(1, 100, 50, 0.0)], [_summary(1, 100, 60, 0.0)]), Slo(2000, 100))
    assert v.best_goodput_ratio is None and not v.meets_goodput_target
    assert v.tpot_p99_ratio_at_reference == pytest.approx(1.2) and not v.meets_tpot_target


def test_experiment_analyze_only_reads_saved_results(tmp_path, capsys):
    out = tmp_path / "exp"
    assert experiment_main(["--analyze-only", "--out-dir", str(out)]) == 2  # nothing saved yet
    for name, runs in (("disaggregated", [_summary(1, 1500, 45, 0.9), _summary(2, 2500, 50, 1.2)]),
                       ("colocated", [_summary(1, 1900, 120, 0.5), _summary(2, 6000, 300, 0.1)])):
        write_json(out / name / "serve_results.json", {}, [BenchRun(s, ()) for s in runs])
    capsys.readouterr()
    assert experiment_main(["--analyze-only", "--out-dir", str(out)]) == 0
    text = capsys.readouterr().out
    assert "at 1 req/s" in text and "ratio 2.67" in text and "ratio 2.40" in text
    doc = json.loads((out / "experiment.json").read_text())
    assert doc["verdict"]["reference_rate"] == 1 and doc["verdict"]["meets_tpot_target"] is True
    assert (out / "experiment.png").read_bytes()[:4] == b"\x89PNG"


def test_saved_runs_are_rescored_under_another_slo(tmp_path, capsys):
    # ttft 0.5 / 3 / 9 s; tpot (e2e - ttft) / 9 = 50 / 50 / 150 ms
    results = [result(0, ttft=0.5, e2e=0.95), result(1, ttft=3.0, e2e=3.45), result(2, ttft=9.0, e2e=10.35),
               result(3, success=False)]
    run = summarize("rate=1", "poisson", 1.0, results, 10.0, Slo(2000, 100))
    path = write_json(tmp_path / "serve_results.json", {}, [BenchRun(run, tuple(results))])
    assert load_summaries(path)[0].num_good == 1
    loose = load_summaries(path, Slo(5000, 100))[0]
    assert loose.num_good == 2 and loose.goodput == pytest.approx(0.2) and loose.slo == Slo(5000, 100)
    assert load_summaries(path, Slo(10000, 200))[0].num_good == 3  # the failed one never counts
    assert load_summaries(path, Slo(10000, 200))[0].ttft == run.ttft  # latencies untouched

    out = tmp_path / "exp"
    for name in SETUPS:
        write_json(out / name / "serve_results.json", {}, [BenchRun(run, tuple(results))])
    assert experiment_main(["--analyze-only", "--out-dir", str(out), "--slo-ttft-ms", "10000",
                            "--slo-tpot-ms", "200"]) == 0
    assert "TTFT <= 10000 ms, TPOT <= 200 ms" in capsys.readouterr().out
    doc = json.loads((out / "experiment.json").read_text())
    assert doc["verdict"]["best_goodput_disaggregated"] == pytest.approx(0.3)


def test_service_group_reports_an_early_exit_with_its_log(tmp_path):
    bad = ServiceSpec("bogus", ("no-such-role",), num_threads=1)
    with ServiceGroup([bad], tmp_path / "logs") as group:
        proc = group._procs[0][1]
        proc.wait(timeout=30)
        with pytest.raises(LaunchError, match="bogus exited with code 2") as e:
            group.check_alive()
        assert "invalid choice" in str(e.value)
    assert group._procs == []


def test_copy_workload_quotes_its_text_and_is_reproducible():
    from pdserve.bench.workload import CopyWorkload

    workload = CopyWorkload(parse_length("120"), parse_length("64"), seed=3)
    first = workload.requests(0, 6)
    assert first == workload.requests(0, 6) and first[3:] == workload.requests(3, 3)
    assert [r.class_name for r in first] == ["repeat", "extract", "rename"] * 2
    for r in first:
        text = r.messages[0].content
        assert r.max_tokens == 64 and len(text.split()) >= 120
    assert "def " in first[2].messages[0].content and "Rename the variable" in first[2].messages[0].content
    assert first != CopyWorkload(parse_length("120"), parse_length("64"), seed=4).requests(0, 6)


def test_speculation_and_text_agreement_are_reported_per_load():
    from pdserve.bench.report import BenchRun, RequestResult, Slo, format_speculation, format_text_agreement, summarize

    def result(i: int, text: str, kept: int | None, rejected: int | None) -> RequestResult:
        return RequestResult(i, "c", True, "", 0.0, 0.1, 1.0, (0.01,) * 9, 20, 10, True, 10, "length", None, 20,
                             text_sha256=text, accepted_prediction_tokens=kept, rejected_prediction_tokens=rejected)

    slo = Slo(1000.0, 100.0)
    a = [result(0, "x", 8, 2), result(1, "y", 6, 4)]
    b = [result(0, "x", None, None), result(1, "z", None, None)]
    run_a = BenchRun(summarize("concurrency=1", "closed", 1, a, 2.0, slo), tuple(a))
    run_b = BenchRun(summarize("concurrency=1", "closed", 1, b, 2.0, slo), tuple(b))
    assert format_speculation("A", [run_a]).splitlines()[1].split()[1:] == [
        "drafts", "kept", "14/20", "(70%),", "2.00", "output", "tokens", "per", "step"]
    assert format_speculation("B", [run_b]) is None
    assert format_text_agreement([run_a], [run_b]).split()[1:5] == ["same", "text", "1", "of"]


def test_the_api_key_is_never_sent_to_the_compared_server():
    from pdserve.bench import serve

    argv = ["--base-url", "http://127.0.0.1:1/v1", "--api-key", "ours", "--compare-url", "http://other:2/v1"]
    args = serve.build_parser().parse_args(argv)
    settings, _ = serve.settings_from_args(args)
    assert settings.endpoint.api_key == "ours"
    assert serve.compare_endpoint(args, settings.endpoint).api_key is None
    args = serve.build_parser().parse_args([*argv, "--compare-api-key", "theirs"])
    assert serve.compare_endpoint(args, settings.endpoint).api_key == "theirs"


def test_a_model_list_takes_turns_request_by_request():
    """`--model base,a1,a2` mixes the base model and LoRA adapters in one run (issue 47)."""
    import asyncio

    from pdserve.bench.stream import Endpoint, OpenAIStreamClient
    from pdserve.bench.workload import BenchRequest, Message

    async def bodies():
        async with OpenAIStreamClient(Endpoint("http://127.0.0.1:1/v1", model="base,a1,a2")) as client:
            return [client.body(BenchRequest(i, "c", (Message("user", "hi"),), 4, None))["model"] for i in range(4)]

    assert asyncio.run(bodies()) == ["base", "a1", "a2", "base"]

"""The planner's simulator against closed-form queueing, its scheduler rules on small cases,
and `pdserve plan`'s answers to bad input."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pdserve.planner import cli as planner_cli
from pdserve.planner.profile import (DecodeTable, Profile, ProfileError, StepCost, TransferCost, load_profile,
                                     save_profile)
from pdserve.planner.search import SearchSpace, SimulatedAdvisor, plan
from pdserve.planner.sim_engine import EngineKnobs
from pdserve.planner.simulator import Deployment, simulate
from pdserve.planner.types import Limits, Slo, WorkloadStats
from pdserve.planner.workload import TraceError, TraceRequest, random_workload, read_trace, write_trace


def constant_profile(step_s: float, **kw) -> Profile:
    """Every step costs `step_s` whatever it computes."""
    return Profile(model="m", compat_hash="00000000000000aa", device="cpu", source="test",
                   step=StepCost(step_s, 0, 0, 0, 0), kv_bytes_per_token=1, kv_tokens=1 << 20,
                   max_model_len=1 << 16, **kw)


def linear_profile(**kw) -> Profile:
    return Profile(model="m", compat_hash="00000000000000aa", device="cpu", source="test",
                   step=StepCost(0.002, 0.0002, 0.0, 0.0005, 1e-6), kv_bytes_per_token=1000,
                   kv_tokens=200_000, max_model_len=8192,
                   transfers=(TransferCost("ucx", 1e9, 0.002),), **kw)


@pytest.mark.parametrize("rho", [0.5, 0.7])
def test_md1_mean_wait_matches_pollaczek_khinchine(rho):
    """One worker, one request per step of fixed length D, Poisson arrivals: an M/D/1 queue,
    whose mean wait is rho * D / (2 (1 - rho)). Pooled over seeds, within 5%."""
    service = 0.1
    profile = constant_profile(service)
    waits = []
    for seed in range(3):
        trace = random_workload(rho / service, 64, 1, 20_000, seed=seed)
        result = simulate(profile, Deployment(0, 1, decode=EngineKnobs(max_batch_size=1)), trace)
        assert np.isfinite(result.ttft_s).all()
        waits.append(result.ttft_s.mean() - service)
    expected = rho * service / (2 * (1 - rho))
    assert float(np.mean(waits)) == pytest.approx(expected, rel=0.05)


def test_one_request_alone_costs_its_steps():
    """A 600-token prompt at a 256-token budget: 3 prefill steps, then one step per token."""
    profile = linear_profile()
    step = profile.step
    trace = (TraceRequest(0.0, 600, 5),)
    result = simulate(profile, Deployment(0, 1, decode=EngineKnobs(max_num_tokens=256)), trace)
    chunks = [(0, 256), (256, 256), (512, 88)]
    prefill = sum(step.seconds(n, n * (s + n / 2), 0, 0) for s, n in chunks)
    assert result.ttft_s[0] == pytest.approx(prefill)
    decode = [step.seconds(0, 0, 1, 600 + i) for i in range(4)]
    assert result.tpot_s[0] == pytest.approx(sum(decode) / 4)


def test_remote_prefill_pays_the_transfer_and_frees_every_block():
    profile = linear_profile()
    trace = random_workload(2.0, 800, 16, 50, seed=1)
    result = simulate(profile, Deployment(1, 1, predict=False), trace)
    assert result.remote.all()
    assert (result.transfer_s[result.remote] >= 0.002 - 1e-9).all()  # at least the link's tail
    assert np.isfinite(result.ttft_s).all() and np.isfinite(result.tpot_s).all()


def test_short_prompts_stay_local():
    result = simulate(linear_profile(), Deployment(1, 1, local_prefill_threshold=32),
                      random_workload(1.0, 20, 8, 20))
    assert not result.remote.any()


def test_capacity_bounds_the_batch():
    """GUARANTEED_NO_EVICT: a cache of 2 requests' full length runs 2 at a time."""
    profile = Profile(model="m", compat_hash="", device="cpu", source="test", step=StepCost(0.01, 0, 0, 0, 0),
                      kv_bytes_per_token=1, kv_tokens=2 * 64, max_model_len=4096)
    trace = tuple(TraceRequest(0.0, 48, 16) for _ in range(4))
    result = simulate(profile, Deployment(0, 1), trace)
    ends = np.sort(result.ttft_s + result.tpot_s * 15)
    assert ends[2] > ends[1] + 0.1  # the second pair starts only after the first is done


def test_plan_ranks_and_reports_every_key():
    profile = linear_profile()
    trace = random_workload(4.0, 512, 64, 150)
    ranked = plan(profile, trace, Slo(2000, 100), 4, 4.0, SearchSpace(chunk_budgets=(256,), max_unit=4))
    keys = {"config", "num_prefill", "num_decode", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms",
            "attainment", "goodput_rps"}
    assert keys <= set(ranked[0].as_json())
    shapes = {(e.config, e.candidate.replicas) for e in ranked}
    assert {("colocated", 4), ("2p2d", 2), ("3p1d", 1)} <= shapes  # 1p1d twice is 2p2d
    assert ranked[0].meets
    assert [e.meets for e in ranked] == sorted((e.meets for e in ranked), reverse=True)


def test_advisor_picks_the_smallest_shape_that_meets(tmp_path):
    advisor = SimulatedAdvisor(linear_profile(), num_requests=80)
    light = advisor.advise(WorkloadStats(0.5, 256, 32), Slo(2000, 100), Limits(0, 2, 1, 2))
    assert light.meets_slo and light.shape.num_prefill + light.shape.num_decode == 1
    impossible = advisor.advise(WorkloadStats(500, 4000, 256), Slo(10, 1), Limits(0, 1, 1, 1))
    assert not impossible.meets_slo and "nearest" in impossible.reason


def _plan(capsys, *argv) -> tuple[int, str, str]:
    import argparse

    parser = argparse.ArgumentParser()
    planner_cli.add_plan_parser(parser.add_subparsers(dest="command"))
    code = planner_cli.run_plan(parser.parse_args(["plan", *argv]))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_refuses_a_profile_of_another_model(tmp_path, capsys):
    path = save_profile(linear_profile(), tmp_path / "p.json")
    code, _, err = _plan(capsys, "--profile", str(path), "--compat-hash", "00000000000000bb",
                         "--request-rate", "1")
    assert code == 2 and "another model" in err
    assert load_profile(path).compat_hash == "00000000000000aa"


def test_plan_says_when_no_candidate_meets_the_slo(tmp_path, capsys):
    path = save_profile(linear_profile(), tmp_path / "p.json")
    code, out, _ = _plan(capsys, "--profile", str(path), "--request-rate", "50", "--input-len", "2000",
                         "--output-len", "64", "--num-requests", "100", "--slo-ttft-ms", "5",
                         "--cores", "2", "--chunk-budgets", "256")
    assert code == 0
    assert "no candidate meets the SLO; the nearest is" in out
    assert "pdserve up" in out and "replicas" in out


def test_plan_json_is_one_object_per_candidate(tmp_path, capsys):
    path = save_profile(linear_profile(), tmp_path / "p.json")
    code, out, _ = _plan(capsys, "--profile", str(path), "--request-rate", "2", "--num-requests", "60",
                         "--cores", "2", "--chunk-budgets", "256", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and {r["config"] for r in rows} >= {"colocated", "1p1d"}


def test_trace_with_a_bad_line_names_it(tmp_path, capsys):
    good = tmp_path / "t.jsonl"
    write_trace(good, [TraceRequest(0.5, 10, 4), TraceRequest(0.0, 20, 8, 16)])
    assert read_trace(good) == (TraceRequest(0.0, 20, 8, 16), TraceRequest(0.5, 10, 4))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "input_len": 10, "output_len": 4}\n\n{"arrival_s": 1, "input_len": "x"}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:3"):
        read_trace(bad)
    path = save_profile(linear_profile(), tmp_path / "p.json")
    code, _, err = _plan(capsys, "--profile", str(path), "--trace", str(bad))
    assert code == 2 and "bad.jsonl:3" in err


def test_profile_file_errors_name_the_field(tmp_path):
    doc = json.loads(linear_profile().to_json())
    doc["step"]["base_s"] = -1
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match="base_s"):
        load_profile(path)
    assert math.isfinite(load_profile(save_profile(linear_profile(), tmp_path / "ok.json")).step.base_s)


def test_transfers_queue_on_a_slow_link():
    """Five 800-token prompts at once over a link of 1 MB/s (0.8 s each, far past the forward):
    the link sends one after another, so the last first token comes after all five."""
    import dataclasses

    profile = dataclasses.replace(linear_profile(), transfers=(TransferCost("slow", 1e6, 0.0),))
    trace = tuple(TraceRequest(0.0, 800, 4) for _ in range(5))
    result = simulate(profile, Deployment(1, 1, predict=False, prefill_queue_threshold=99), trace)
    assert result.remote.all()
    assert result.ttft_s.max() >= 5 * 0.8


def test_decode_table_prices_decode_steps_and_round_trips(tmp_path):
    """A decode step is the measured step of its batch at its context per sequence, linear
    between measurements and past them; prompt tokens in the step add the linear terms."""
    table = DecodeTable(((1, 100, 0.010), (4, 100, 0.016), (1, 300, 0.012), (4, 300, 0.020)))
    profile = linear_profile(decode_table=table, served_step_s=0.001)
    assert profile.step_seconds(0, 0, 1, 100) == pytest.approx(0.011)
    assert profile.step_seconds(0, 0, 2, 400) == pytest.approx(0.001 + (0.012 + 0.012 + 0.008 / 3) / 2)  # 200 each
    assert profile.step_seconds(0, 0, 8, 8 * 100) == pytest.approx(0.001 + 0.024)  # past the last batch
    assert profile.step_seconds(10, 50, 1, 300) == pytest.approx(0.001 + 0.012 + 0.0002 * 10)
    assert profile.step_seconds(10, 0, 0, 0) == pytest.approx(0.001 + 0.002 + 0.002)  # no decode: the linear model
    loaded = load_profile(save_profile(profile, tmp_path / "p.json"))
    assert loaded.decode_table == table and loaded.served_step_s == 0.001
    with pytest.raises(ProfileError, match="two batch sizes"):
        DecodeTable(((1, 100, 0.01), (1, 300, 0.012)))


def test_an_older_profile_gets_its_decode_table_from_its_samples(tmp_path):
    doc = json.loads(linear_profile().to_json())
    del doc["decode_table"], doc["served_step_s"]
    doc["samples"] = {"decode": [{"batch": 1, "context": 128, "step_s": 0.01},
                                 {"batch": 8, "context": 128, "step_s": 0.03}]}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    loaded = load_profile(path)
    assert loaded.decode_table == DecodeTable(((1, 128, 0.01), (8, 128, 0.03)))
    assert loaded.served_step_s == 0.0


def test_plan_served_step_lengthens_every_step_and_refuses_a_negative_one(tmp_path, capsys):
    path = save_profile(linear_profile(), tmp_path / "p.json")
    args = ("--profile", str(path), "--request-rate", "1", "--num-requests", "40", "--cores", "2",
            "--chunk-budgets", "256", "--json")
    code, out, _ = _plan(capsys, *args)
    served_code, served_out, _ = _plan(capsys, *args, "--served-step-ms", "20")
    assert code == served_code == 0
    tpot = {o["config"]: o["tpot_p50_ms"] for o in map(json.loads, out.splitlines())}
    served = {o["config"]: o["tpot_p50_ms"] for o in map(json.loads, served_out.splitlines())}
    assert served["colocated"] >= tpot["colocated"] + 19
    code, _, err = _plan(capsys, *args, "--served-step-ms", "-1")
    assert code == 2 and "served_step_s" in err

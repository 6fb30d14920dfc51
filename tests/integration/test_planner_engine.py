"""The planner's simulator against the real engine on a tiny random-weight model.

A Poisson workload runs through the engine in real time; every step's work and seconds are
kept, and the step cost fitted to them (`fit_step_cost`, as `pdserve profile` fits its own
steps) prices the simulation of the same workload. Mean TTFT and TPOT agree within `BAND`.
The cost comes from the run itself because this machine is shared: a profile measured a
minute earlier can be 2x off from the run (other processes come and go); what this test
checks is the simulator's scheduling and queueing, given the steps' cost. The profiler is
checked apart (it measures the same engine, and its hash is the engine's)."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from pdserve.planner.compat import model_compat_hash
from pdserve.planner.profile import fit_step_cost
from pdserve.planner.profiler import QUICK, measure
from pdserve.planner.sim_engine import EngineKnobs
from pdserve.planner.simulator import Deployment, simulate
from pdserve.planner.workload import random_workload

BAND = 0.35  # |simulated / measured - 1| for mean TTFT and mean TPOT


def run_engine(model_dir, trace, budget: int) -> tuple[np.ndarray, np.ndarray, list]:
    """Each request enters the engine once its arrival time has passed (checked between steps,
    as the engine loop does); TTFT and TPOT as the caller sees them, and each step's
    (prefill tokens, prefill attention work, decoding sequences, their context, seconds)."""
    from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    # one thread: on a shared 2-core machine a second thread's waits swing the step times
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_threads=1, cache=CacheConfig(max_tokens=8192),
                                    scheduler=SchedulerConfig(max_num_tokens=budget)))
    steps, plans = [], []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        plans.append(schedule())
        return plans[-1]

    engine.scheduler.schedule = recording_schedule
    rng = np.random.default_rng(0)
    pending = list(enumerate(trace))
    arrivals, first, last = {}, {}, {}
    start = time.monotonic()
    deadline = start + 120
    while (pending or engine.has_unfinished()) and time.monotonic() < deadline:
        now = time.monotonic() - start
        while pending and pending[0][1].arrival_s <= now:
            i, r = pending.pop(0)
            prompt = [int(x) for x in rng.integers(3, 250, r.input_len)]
            engine.add_request(prompt, SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True),
                               request_id=str(i))
            arrivals[str(i)] = start + r.arrival_s
        if not engine.has_unfinished():
            time.sleep(min(0.005, max(0.0, pending[0][1].arrival_s - now)))  # the next arrival is due
            continue
        began = time.perf_counter()
        outputs, _ = engine.step()
        steps.append((plans[-1], time.perf_counter() - began))
        for out in outputs:
            first.setdefault(out.request_id, time.monotonic())
            if out.finished:
                last[out.request_id] = time.monotonic()
    assert len(last) == len(trace), "the engine did not finish the workload in time"
    engine.assert_no_leaks()
    ids = [str(i) for i in range(len(trace))]
    ttft = np.array([first[i] - arrivals[i] for i in ids])
    tpot = np.array([(last[i] - first[i]) / (r.output_len - 1) for i, r in zip(ids, trace)])
    return ttft, tpot, [_work(plan, seconds) for plan, seconds in steps if plan.chunks]


def _work(plan, seconds: float) -> tuple[float, float, float, float, float]:
    prefill = attention = decodes = context = 0
    for chunk in plan.chunks:
        if chunk.start < chunk.request.num_prompt_tokens:
            prefill += chunk.num_new_tokens
            attention += chunk.num_new_tokens * (chunk.start + chunk.num_new_tokens / 2)
        else:
            decodes += 1
            context += chunk.start
    return prefill, attention, decodes, context, seconds


@pytest.mark.timeout(300)
def test_simulator_tracks_the_engine_on_a_tiny_model(tiny_model_factory):
    model_dir = tiny_model_factory("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    profile = measure(str(model_dir), grid=QUICK, num_threads=1)
    assert profile.compat_hash == model_compat_hash(str(model_dir))
    trace = random_workload(6.0, 160, 24, 60, seed=3)
    measured_ttft, measured_tpot, rows = run_engine(model_dir, trace, budget=256)
    profile = dataclasses.replace(profile, step=fit_step_cost(rows), decode_table=None)  # the run prices every step
    result = simulate(profile, Deployment(0, 1, decode=EngineKnobs(max_num_tokens=256)), trace)
    sim_ttft, sim_tpot = result.ttft_s.mean(), result.tpot_s.mean()
    report = (f"TTFT measured {measured_ttft.mean() * 1000:.1f} ms, simulated {sim_ttft * 1000:.1f} ms; "
              f"TPOT measured {measured_tpot.mean() * 1000:.2f} ms, simulated {sim_tpot * 1000:.2f} ms")
    print(report)
    assert abs(sim_ttft / measured_ttft.mean() - 1) <= BAND, report
    assert abs(sim_tpot / measured_tpot.mean() - 1) <= BAND, report


@pytest.mark.timeout(300)
def test_profile_command_then_plan_refuses_other_weights(tiny_model_factory, tmp_path, capsys):
    """`pdserve profile --quick` writes a profile carrying the engine's compatibility hash, the
    machine and a measured link; `pdserve plan --model` takes it for that model and refuses it
    for the same architecture with other weights."""
    from pdserve.deploy.cli import main
    from pdserve.planner.profile import load_profile

    model_dir = tiny_model_factory("llama")
    other = tiny_model_factory("llama", seed=1)
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", str(model_dir), "--quick", "--num-threads", "1", "--out", str(out)]) == 0
    profile = load_profile(out)
    assert profile.compat_hash == model_compat_hash(str(model_dir)) != model_compat_hash(str(other))
    assert profile.machine.num_cores >= 1 and profile.kv_tokens_by_fraction
    assert [t.backend for t in profile.transfers] == ["socket"]
    assert profile.device == "cpu" and len(profile.decode_table.points) == 6  # QUICK: 3 batches x 2 contexts
    capsys.readouterr()
    assert main(["plan", "--profile", str(out), "--model", str(model_dir), "--request-rate", "2",
                 "--input-len", "64", "--output-len", "8", "--num-requests", "40"]) == 0
    assert "recommended" in capsys.readouterr().out
    assert main(["plan", "--profile", str(out), "--model", str(other), "--request-rate", "2"]) == 2
    assert "another model or other weights" in capsys.readouterr().err

"""`pdserve bench serve` end to end against a small OpenAI-compatible streaming server.

The server (FastAPI + uvicorn on a free 127.0.0.1 port, in a thread) streams one word per
SSE chunk and ends with a usage chunk. It counts prompt words as prompt tokens and stops
some requests early, so the benchmark must take its token counts from the responses, not
from what it asked for. It remembers what it sent per prompt; the tests match the
benchmark's JSON against that record.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pdserve.bench.workload import SyntheticWorkload, parse_mix
from pdserve.deploy.cli import main as pdserve_main

API_KEY = "test-key"
FIRST_TOKEN_DELAY_S = 0.004
TOKEN_DELAY_S = 0.001


def completion_tokens_for(prompt: str, max_tokens: int) -> tuple[int, str]:
    """Deterministic stand-in for a model: every third prompt (by length) stops early."""
    if len(prompt.split()) % 3 == 0 and max_tokens > 2:
        return max_tokens // 2, "stop"
    return max_tokens, "length"


def make_app(sent: dict[str, tuple[int, int]], api_key: str | None = API_KEY) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def generate(request: Request, chat: bool):
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        body = await request.json()
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        prompt = ("\n".join(m["content"] for m in body["messages"]) if chat else body["prompt"])
        num_out, finish = completion_tokens_for(prompt, body["max_tokens"])
        if body.get("ignore_eos") is True:
            num_out, finish = body["max_tokens"], "length"
        num_prompt = len(prompt.split())
        sent[prompt] = (num_prompt, num_out)

        async def events():
            await asyncio.sleep(FIRST_TOKEN_DELAY_S)
            for i in range(num_out):
                if i:
                    await asyncio.sleep(TOKEN_DELAY_S)
                last = i == num_out - 1
                choice = ({"index": 0, "delta": {"content": f" w{i}"}} if chat
                          else {"index": 0, "text": f" w{i}"})
                choice["finish_reason"] = finish if last else None
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            usage = {"prompt_tokens": num_prompt, "completion_tokens": num_out,
                     "total_tokens": num_prompt + num_out}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    return app


@contextlib.contextmanager
def serving(app: FastAPI, port: int):
    """`app` on 127.0.0.1:`port` in a thread, started and stopped with deadlines."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert thread.is_alive(), "fake server died"
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert not thread.is_alive(), "fake server did not stop"


@pytest.fixture
def fake_server(free_port):
    sent: dict[str, tuple[int, int]] = {}
    with serving(make_app(sent), free_port) as base_url:
        yield base_url, sent


def check_consistent(doc: dict, sent: dict[str, tuple[int, int]], prompts: dict[int, str]) -> None:
    """Token counts match what the server sent; percentiles ordered; goodput <= throughput."""
    for run in doc["runs"]:
        s = run["summary"]
        assert s["num_failed"] == 0 and s["num_succeeded"] == s["num_requests"] > 0
        assert 0 <= s["goodput"] <= s["request_throughput"] + 1e-12
        assert s["num_good"] <= s["num_succeeded"]
        for key in ("ttft", "tpot", "itl", "e2e"):
            st = s[key]
            assert st["count"] > 0
            assert 0 <= st["p50_ms"] <= st["p90_ms"] <= st["p99_ms"] <= st["max_ms"]
        assert s["ttft"]["p50_ms"] >= FIRST_TOKEN_DELAY_S * 1000 * 0.9
        assert s["e2e"]["max_ms"] >= s["ttft"]["max_ms"]
        total_out = 0
        for r in run["requests"]:
            num_prompt, num_out = sent[prompts[r["index"]]]
            assert r["usage_reported"] is True
            assert r["prompt_tokens"] == num_prompt
            assert r["output_tokens"] == num_out == r["num_chunks"]
            assert len(r["itl_s"]) == num_out - 1
            assert r["ttft_s"] <= r["e2e_s"]
            if r["target_input_tokens"] is not None:  # synthetic: 1 word = 1 token here
                assert r["target_input_tokens"] == num_prompt
            total_out += num_out
        assert s["total_output_tokens"] == total_out
        assert s["output_throughput"] == pytest.approx(total_out / s["duration_s"])


def test_rate_sweep_chat_writes_json_and_plots(fake_server, tmp_path):
    base_url, sent = fake_server
    mix = ["long:1:40-60:6-10", "chat:2:5-15:3-5"]
    out = tmp_path / "out"
    argv = ["bench", "serve", "--base-url", base_url, "--api-key", API_KEY,
            "--request-rates", "40,80", "--arrival", "poisson", "--num-requests", "8",
            "--seed", "7", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50",
            "--request-timeout-s", "20", "--out-dir", str(out), "--no-progress"]
    for m in mix:
        argv += ["--mix", m]
    assert pdserve_main(argv) == 0

    doc = json.loads((out / "serve_results.json").read_text())
    assert doc["config"]["endpoint"]["model"] == "fake-model"  # resolved from /models
    assert doc["config"]["endpoint"]["api_key"] == "***"  # never written out
    assert [r["summary"]["label"] for r in doc["runs"]] == ["rate=40", "rate=80"]
    workload = SyntheticWorkload(parse_mix(mix), seed=7)
    prompts = {r.index: r.prompt_text() for r in workload.requests(0, 16)}
    # run k sent requests k*8 .. k*8+7: no prompt repeated across the sweep
    assert sorted(r["index"] for run in doc["runs"] for r in run["requests"]) == list(range(16))
    assert len(sent) == 16
    check_consistent(doc, sent, prompts)
    for name in ("latency_cdf.png", "sweep.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_closed_loop_completions_with_dataset(fake_server, tmp_path):
    base_url, sent = fake_server
    dataset = tmp_path / "conv.jsonl"
    rows = [{"messages": [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "tell me about the sea"}], "max_tokens": 7},
            {"prompt": "one two three four five six", "max_tokens": 4},
            {"messages": [{"role": "user", "content": "hi"}]}]
    dataset.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    out = tmp_path / "out"
    rc = pdserve_main(["bench", "serve", "--base-url", base_url, "--api-key", API_KEY,
                       "--model", "anything", "--endpoint", "completions",
                       "--concurrency", "2", "--num-requests", "6", "--dataset", str(dataset),
                       "--output-len", "5", "--request-timeout-s", "20", "--warmup-requests", "1",
                       "--out-dir", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads((out / "serve_results.json").read_text())
    (run,) = doc["runs"]
    assert run["summary"]["label"] == "concurrency=2"
    assert [r["max_tokens"] for r in run["requests"]] == [7, 4, 5, 7, 4, 5]
    prompts = {i: ["be brief\ntell me about the sea", "one two three four five six", "hi"][i % 3]
               for i in range(6)}
    check_consistent(doc, sent, prompts)
    assert (out / "latency_cdf.png").exists() and not (out / "sweep.png").exists()


def test_failures_are_recorded_not_raised(fake_server, tmp_path, capsys):
    base_url, _ = fake_server
    out = tmp_path / "out"
    rc = pdserve_main(["bench", "serve", "--base-url", base_url, "--api-key", "wrong",
                       "--model", "m", "--request-rates", "inf", "--num-requests", "3",
                       "--input-len", "5", "--output-len", "3", "--request-timeout-s", "20",
                       "--out-dir", str(out), "--no-progress", "--no-plots"])
    assert rc == 1  # nothing succeeded
    (run,) = json.loads((out / "serve_results.json").read_text())["runs"]
    s = run["summary"]
    assert (s["num_failed"], s["num_succeeded"], s["goodput"], s["request_throughput"]) == (3, 0, 0, 0)
    assert s["errors"][0][0].startswith("HTTP 401") and s["errors"][0][1] == 3
    assert "HTTP 401" in capsys.readouterr().out
    assert not (out / "latency_cdf.png").exists()


def test_bad_arguments_exit_2_without_sending(fake_server, tmp_path, capsys):
    base_url, sent = fake_server
    rc = pdserve_main(["bench", "serve", "--base-url", base_url, "--input-len", "10-5",
                       "--no-progress"])
    assert rc == 2
    assert "need 1 <= low <= high" in capsys.readouterr().err
    assert sent == {}


def test_experiment_machinery_against_fake_services(tmp_path, free_port):
    """Launch (pinned, one thread), wait ready, bench, stop, save, analyse: the experiment's
    whole path with this file's server in place of the pdserve services."""
    from pdserve.bench import experiment
    from pdserve.bench.comparison import SETUPS, write_analysis
    from pdserve.bench.launch import ServiceSpec

    core = sorted(os.sched_getaffinity(0))[0]
    args = experiment.build_parser().parse_args([
        "--rates", "30,60", "--num-requests", "4", "--mix", "a:1:5-10:3-5",
        "--warmup-requests", "1", "--request-timeout-s", "20"])
    settings, workload = experiment.settings_from_args(args)
    out = tmp_path / "exp"
    series = {}
    for name in SETUPS:
        fake = ServiceSpec("fake", ("--port", str(free_port)), cpus=(core,), num_threads=1,
                           program=(os.path.abspath(__file__),))
        plan = experiment.SetupPlan(name, (fake,), f"http://127.0.0.1:{free_port}/v1")
        series[name] = experiment.run_setup(plan, settings, workload, out, ready_timeout_s=60,
                                            progress=False)
        assert [s.num_succeeded for s in series[name]] == [4, 4]
        assert f"affinity [{core}] threads 1" in (out / name / "logs" / "fake.log").read_text()
        doc = json.loads((out / name / "serve_results.json").read_text())
        assert doc["config"]["endpoint"]["model"] == "fake-model"
        # the experiment sends ignore_eos by default: every output runs to max_tokens
        assert all(r["output_tokens"] == r["max_tokens"] for run in doc["runs"] for r in run["requests"])
        assert (out / name / "latency_cdf.png").exists() and (out / name / "sweep.png").exists()
    with pytest.raises(OSError):  # stopped: nothing listens any more
        socket.create_connection(("127.0.0.1", free_port), timeout=2).close()
    text = write_analysis(out, series, settings.slo)
    assert "best goodput" in text
    assert json.loads((out / "experiment.json").read_text())["comparisons"][0]["rate"] == 30
    assert (out / "experiment.png").exists()


if __name__ == "__main__":  # the stand-in service of the experiment test
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    print(f"affinity {sorted(os.sched_getaffinity(0))} threads {os.environ.get('OMP_NUM_THREADS')}",
          flush=True)
    import uvicorn

    uvicorn.run(make_app({}, api_key=None), host="127.0.0.1", port=port, log_level="warning")
    sys.exit(0)


def test_compare_url_sends_the_same_requests_to_both_servers_and_prints_ratios(fake_server, tmp_path, capsys):
    """`--compare-url`: the same workload, load by load, against a second server (its own
    key and model from its /models), both tables and a ratio table, outputs for both."""
    base_url, sent = fake_server
    other_sent: dict[str, tuple[int, int]] = {}
    out = tmp_path / "out"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with serving(make_app(other_sent, api_key="other-key"), port) as other_url:
        rc = pdserve_main(["bench", "serve", "--base-url", base_url, "--api-key", API_KEY,
                           "--compare-url", other_url, "--compare-api-key", "other-key",
                           "--concurrency", "2,4", "--num-requests", "6", "--input-len", "5-20",
                           "--output-len", "3-6", "--out-dir", str(out), "--no-plots", "--no-progress"])
    assert rc == 0
    assert sent == other_sent and len(sent) == 12  # the same 12 prompts, each answered alike
    text = capsys.readouterr().out
    assert f"at http://127.0.0.1:{port}/v1" in text and f"ratios, {base_url} vs http://127.0.0.1:{port}/v1" in text
    ratio_rows = text.split("ratios,")[1].strip().splitlines()[2:4]
    assert [row.split()[0] for row in ratio_rows] == ["concurrency=2", "concurrency=4"]
    assert all(row.split()[1].endswith("x") for row in ratio_rows)
    # both servers answer a prompt alike: every text the same
    agreement = text.split("ratios,")[1].strip().splitlines()[4:]
    assert [row.split() for row in agreement] == [[f"concurrency={c}", "same", "text", "6", "of", "6", "requests",
                                                   "answered", "by", "both"] for c in (2, 4)]
    for doc in (json.loads((out / "serve_results.json").read_text()),
                json.loads((out / "compare" / "serve_results.json").read_text())):
        assert [r["summary"]["num_succeeded"] for r in doc["runs"]] == [6, 6]


class _Arrivals(dict):
    """A fake server's record of what it sent, which also logs the order prompts arrived in
    across both servers (`log`: (server, prompt))."""

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        super().__init__()
        self._name, self._log = name, log

    def __setitem__(self, prompt, value) -> None:
        self._log.append((self._name, prompt))
        super().__setitem__(prompt, value)


def test_rounds_take_turns_going_first_on_fresh_requests_and_pool_each_side(free_port, tmp_path, capsys):
    """`--rounds 2`: at each load the base server goes first in round 1 and second in round 2,
    each round on requests of its own (no prompt twice at one server); each side's JSON holds
    one pooled run per load with every request of both rounds; a line per round gives its
    throughput ratio."""
    log: list[tuple[str, str]] = []
    base_sent, other_sent = _Arrivals("base", log), _Arrivals("other", log)
    out = tmp_path / "out"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with serving(make_app(base_sent), free_port) as base_url, \
            serving(make_app(other_sent, api_key="other-key"), port) as other_url:
        rc = pdserve_main(["bench", "serve", "--base-url", base_url, "--api-key", API_KEY,
                           "--compare-url", other_url, "--compare-api-key", "other-key", "--rounds", "2",
                           "--concurrency", "2,3", "--num-requests", "4", "--input-len", "5-20",
                           "--output-len", "3-6", "--out-dir", str(out), "--no-plots", "--no-progress"])
    assert rc == 0
    assert base_sent == other_sent and len(base_sent) == 2 * 2 * 4  # loads x rounds x requests
    assert len(log) == 2 * len(base_sent)  # no prompt was sent twice to one server
    blocks = [log[i:i + 4] for i in range(0, len(log), 4)]  # one server's run of one round each
    firsts = [block[0][0] for block in blocks[::2]]
    assert all(len({name for name, _ in block}) == 1 for block in blocks)
    assert firsts == ["base", "other", "base", "other"]  # load 1 rounds 1-2, load 2 rounds 1-2
    text = capsys.readouterr().out
    assert [line.split()[0:3] for line in text.splitlines() if " round " in line] == [
        ["concurrency=2", "round", "1"], ["concurrency=2", "round", "2"],
        ["concurrency=3", "round", "1"], ["concurrency=3", "round", "2"]]
    for doc in (json.loads((out / "serve_results.json").read_text()),
                json.loads((out / "compare" / "serve_results.json").read_text())):
        assert [r["summary"]["num_succeeded"] for r in doc["runs"]] == [8, 8]
        for run in doc["runs"]:
            s = run["summary"]
            assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration_s"])


def test_rounds_without_a_second_server_exit_2(fake_server, capsys):
    base_url, sent = fake_server
    rc = pdserve_main(["bench", "serve", "--base-url", base_url, "--api-key", API_KEY, "--rounds", "2",
                       "--concurrency", "2", "--num-requests", "2", "--no-progress"])
    assert rc == 2 and not sent
    assert "--compare-url" in capsys.readouterr().err

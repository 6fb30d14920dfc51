"""`pdserve up --local-prefill`: router + one decode service prefilling every prompt itself.
The official OpenAI client and a gRPC client get transformers' greedy text."""
from __future__ import annotations

import grpc
import pytest
from harness import MODEL, deploy

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def local():
    d = deploy(local_prefill=True)
    yield d
    from pdserve.deploy import up

    up.stop(d.children)


def _stream_text(stream) -> str:
    parts = []
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0]
            parts.append(getattr(delta, "delta", None).content if hasattr(delta, "delta") else delta.text)
    return "".join(p for p in parts if p)


def test_chat_and_completions_match_transformers(local, hf_reference):
    _, greedy = hf_reference
    client = local.openai()
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == greedy(CHAT, 24)
    assert chat.usage.completion_tokens <= 24
    transfer = chat.model_extra["pdserve"]["transfer"]
    assert transfer["outcome"] == "local"
    local.assert_ttft_phases(chat.model_extra["pdserve"]["timings"], transfer=False)

    streamed = _stream_text(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=24, temperature=0, stream=True))
    assert streamed == greedy(CHAT, 24)

    comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert comp.choices[0].text == greedy(PROMPT, 16)
    streamed = _stream_text(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True))
    assert streamed == greedy(PROMPT, 16)
    local.assert_no_leaks()


def test_grpc_generate_streams_the_same_text(local, hf_reference):
    from pdserve.proto.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    _, greedy = hf_reference
    with grpc.insecure_channel(f"127.0.0.1:{local.grpc_port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(
            chat=generation_pb2.ChatMessages(messages=[
                generation_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in CHAT]),
            sampling=common_pb2.SamplingParams(max_tokens=24, temperature=0))
        text = "".join(r.text for r in stub.Generate(request, timeout=120))
    assert text == greedy(CHAT, 24)
    local.assert_no_leaks()


def test_bad_input_gets_openai_errors_and_service_stays_healthy(local):
    import httpx

    url = local.base_url
    with httpx.Client(timeout=30) as http:
        cases = [
            (b"{not json", 400),
            (b"[1, 2]", 400),
            (b'{"model": "nope", "prompt": "hi"}', 404),
            (b'{"model": "%s", "prompt": "hi", "max_tokens": 0}' % MODEL.encode(), 400),
            (b'{"model": "%s", "prompt": "hi", "temperature": -1}' % MODEL.encode(), 400),
            (b'{"model": "%s", "prompt": "hi", "top_p": 1.5}' % MODEL.encode(), 400),
            (b'{"model": "%s", "prompt": "hi", "max_tokens": 100000}' % MODEL.encode(), 400),
        ]
        for body, status in cases:
            r = http.post(f"{url}/completions", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (body, r.text)
            assert set(r.json()["error"]) >= {"message", "type"}
        ok = http.post(f"{url}/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200
    local.assert_no_leaks()


def test_bench_serve_against_the_real_router(local, tmp_path):
    """`pdserve bench serve` briefly against this router: its numbers are consistent."""
    import json

    from pdserve.deploy.cli import main

    rc = main(["bench", "serve", "--base-url", local.base_url, "--model", MODEL,
               "--concurrency", "2", "--num-requests", "6", "--input-len", "40-80",
               "--output-len", "8", "--ignore-eos", "--temperature", "0", "--seed", "3",
               "--slo-ttft-ms", "5000", "--slo-tpot-ms", "500", "--out-dir", str(tmp_path),
               "--no-progress"])
    assert rc == 0
    data = json.loads((tmp_path / "serve_results.json").read_text())
    run = data["runs"][0]
    requests = run["requests"]
    assert len(requests) == 6 and all(r["success"] for r in requests)
    # ignore_eos: exactly max_tokens each, as counted from the streamed chunks and usage
    assert all(r["output_tokens"] == 8 == r["num_chunks"] for r in requests)
    summary = run["summary"]
    for metric in ("ttft", "tpot", "itl", "e2e"):
        p = summary[metric]
        assert 0 < p["p50_ms"] <= p["p90_ms"] <= p["p99_ms"] <= p["max_ms"], (metric, p)
    assert summary["goodput"] <= summary["request_throughput"] + 1e-9
    assert summary["total_output_tokens"] == sum(r["output_tokens"] for r in requests)
    assert summary["total_prompt_tokens"] == sum(r["prompt_tokens"] for r in requests)
    assert list(tmp_path.glob("*.png"))
    local.assert_no_leaks()

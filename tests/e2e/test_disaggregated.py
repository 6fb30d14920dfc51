"""Disaggregated serving over every transfer backend, on real processes on 127.0.0.1.

One router, one prefill service speaking every backend, and one decode service per backend
(each offering only that backend, so its verdict must name it). Round-robin decode routing
sends consecutive requests to each decode service in turn.
"""
from __future__ import annotations

import pytest
from harness import MODEL, deploy_workers

pytestmark = pytest.mark.slow

BACKENDS = ("ucx", "nccl", "redis", "disk")
CHAT = [{"role": "user", "content": "Name three animals that live in the ocean, with one fact about each."}]
PROMPT = ("A short story about a lighthouse keeper who finds a message in a bottle. "
          "It begins on a stormy night, when")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from support import RedisServer, redis_server_binary

    redis = RedisServer(redis_server_binary(), tmp_path_factory.mktemp("redis"))
    redis.start()
    store = str(tmp_path_factory.mktemp("kvstore"))
    stores = ["--redis-url", redis.url, "--disk-store", store]
    workers = [("prefill-0", "prefill", ["--kv-backends", ",".join(BACKENDS), *stores])]
    workers += [(f"decode-{b}", "decode", ["--kv-backends", b, *stores,
                                            "--failure-policy", "fail"]) for b in BACKENDS]
    d = deploy_workers(workers, router_args=["--decode-policy", "round_robin",
                                             "--local-prefill-threshold", "0", "--static-routing"])
    yield d
    from pdserve.deploy import up

    up.stop(d.children)
    redis.stop()


def test_every_backend_carries_the_kv_and_text_matches_transformers(cluster, hf_reference):
    _, greedy = hf_reference
    client = cluster.openai()
    seen = {}
    for _ in range(len(BACKENDS)):
        chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
        info = chat.model_extra["pdserve"]
        transfer = info["transfer"]
        decode = info["routing"]["decode_worker_id"]
        assert transfer["outcome"] == "transferred", transfer
        assert transfer["fallbacks"] == [], transfer
        assert f"decode-{transfer['backend']}" == decode
        assert transfer["blocks"] >= 2 and transfer["bytes"] > 0
        assert chat.choices[0].message.content == greedy(CHAT, 24), decode
        cluster.assert_ttft_phases(info["timings"], transfer=True)
        seen[transfer["backend"]] = True
    assert sorted(seen) == sorted(BACKENDS)
    cluster.assert_no_leaks()


def test_streaming_completions_through_every_backend(cluster, hf_reference):
    _, greedy = hf_reference
    client = cluster.openai()
    backends = set()
    for _ in range(len(BACKENDS)):
        text, transfer = [], None
        for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                               temperature=0, stream=True):
            transfer = transfer or (chunk.model_extra.get("pdserve") or {}).get("transfer")
            if chunk.choices:
                text.append(chunk.choices[0].text)
        assert "".join(text) == greedy(PROMPT, 16)
        assert transfer and transfer["outcome"] == "transferred"
        backends.add(transfer["backend"])
    assert backends == set(BACKENDS)
    cluster.assert_no_leaks()


def test_the_routers_metrics_show_every_workers_engine_and_transfers(cluster):
    """After one chat through each decode (each offering one backend), one scrape of the
    router shows each worker's engine numbers and the prefill's transfers on every backend
    (from heartbeats, labelled by worker)."""
    import re
    import time

    import httpx

    client = cluster.openai()
    for _ in BACKENDS:  # round robin: one per decode service, so one per backend
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)

    def scrape() -> dict[tuple[str, str, str], float]:
        text = httpx.get(cluster.base_url.replace("/v1", "/metrics"), timeout=10).text
        out = {}
        for name, labels, value in re.findall(r'^(pdserve:\w+)\{([^}]*)\} (\S+)$', text, re.M):
            fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            out[(name, fields["worker_id"], fields.get("backend", ""))] = float(value)
        return out

    def complete(m) -> bool:
        """Every worker's last heartbeat reflects the chats (they report independently)."""
        return (all(m.get(("pdserve:kv_transfer_bytes_total", "prefill-0", b), 0) > 0 for b in BACKENDS)
                and all(m.get(("pdserve:engine_steps_total", f"decode-{b}", ""), 0) > 0
                        and m.get(("pdserve:num_requests_running", f"decode-{b}", "")) == 0 for b in BACKENDS))

    deadline = time.monotonic() + 15
    while not complete(m := scrape()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(m[("pdserve:kv_transfer_bytes_total", "prefill-0", b)] > 0 for b in BACKENDS), m
    assert all(m[("pdserve:kv_transfers_total", "prefill-0", b)] >= 1 for b in BACKENDS)
    assert m[("pdserve:prompt_tokens_total", "prefill-0", "")] > 0
    for b in BACKENDS:
        decode = f"decode-{b}"
        assert m[("pdserve:generation_tokens_total", decode, "")] > 0  # the prefill drew each first token
        assert m[("pdserve:engine_steps_total", decode, "")] > 0 and m[("pdserve:engine_step_seconds_total", decode, "")] > 0
        assert m[("pdserve:num_requests_running", decode, "")] == 0
        assert 0 <= m[("pdserve:kv_cache_usage_perc", decode, "")] < 1
        assert m[("pdserve:prefix_cache_queries_total", decode, "")] > 0

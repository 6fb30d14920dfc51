"""Every KV backend down, on real processes: a prefill and a decode that speak only Redis (a
real server), which is stopped and later started again. No prompt is computed twice beyond
what it takes the circuit breaker to open; health says which backend is down and why; the
probe after the cool-down brings remote prefill back by itself. Every text is transformers'."""
from __future__ import annotations

import time

import httpx
import pytest
from harness import MODEL, deploy_workers

pytestmark = pytest.mark.slow

FAILURE_THRESHOLD = 3  # kvtransfer.config: failures in a row that open the breaker
COOLDOWN_S = 20  # long enough that health still says "degraded" after the slow requests below


@pytest.fixture(scope="module")
def outage(tmp_path_factory):
    from support import RedisServer, redis_server_binary

    redis = RedisServer(redis_server_binary(), tmp_path_factory.mktemp("redis"))
    redis.start()
    flags = ["--kv-backends", "redis,recompute", "--redis-url", redis.url, "--kv-probe-cooldown-s", str(COOLDOWN_S)]
    d = deploy_workers([("prefill-0", "prefill", flags), ("decode-0", "decode", flags)],
                       router_args=["--local-prefill-threshold", "0", "--static-routing"])
    yield d, redis
    from pdserve.deploy import up

    up.stop(d.children)
    redis.stop()


def _messages(i: int) -> list[dict]:
    # a new prompt each time: a cached one would be prefilled locally as "short_uncached_prompt"
    return [{"role": "user", "content": f"Question {i}: name one animal that lives in the ocean."}]


def _health(d) -> dict:
    return httpx.get(f"http://127.0.0.1:{d.http_port}/health", timeout=10).json()


def test_every_backend_down_no_prompt_computed_twice_and_the_probe_brings_it_back(outage, hf_reference):
    d, redis = outage
    _, greedy = hf_reference
    client = d.openai()
    counter = iter(range(1000))

    def ask() -> dict:
        i = next(counter)
        chat = client.chat.completions.create(model=MODEL, messages=_messages(i), max_tokens=6, temperature=0)
        assert chat.choices[0].message.content == greedy(_messages(i), 6)
        return chat.model_extra["pdserve"]

    first = ask()
    assert (first["transfer"]["outcome"], first["transfer"]["backend"]) == ("transferred", "redis")
    assert _health(d)["kv_transfer"] == "ok"

    redis.stop()
    computed_twice, skipped = 0, None
    for _ in range(12):
        info = ask()
        if info["routing"]["prefill_reason"] == "no_usable_kv_backend":
            assert info["transfer"]["outcome"] == "local"
            skipped = info
            break
        reason = info["transfer"]["reason"]
        assert info["transfer"]["outcome"] == "recomputed", info["transfer"]
        if not reason.startswith("no_usable_kv_backend"):  # the prefill computed it, then redis failed
            computed_twice += 1
    assert skipped is not None, "the router kept asking a prefill whose only backend is down"
    assert computed_twice <= FAILURE_THRESHOLD
    health = _health(d)
    assert health["status"] == "ok" and health["kv_transfer"] == "degraded", health
    assert health["kv_backends"]["prefill-0"]["redis"].startswith("unusable: unhealthy after"), health
    metrics = httpx.get(f"http://127.0.0.1:{d.http_port}/metrics", timeout=10).text
    assert 'pdserve_router_kv_backend_usable{backend="redis",worker_id="prefill-0"} 0.0' in metrics

    redis.start()  # same port: after the cool-down a request probes it and succeeds
    deadline = time.monotonic() + COOLDOWN_S + 60
    while True:
        info = ask()
        if info["transfer"]["outcome"] == "transferred":
            assert info["transfer"]["backend"] == "redis"
            break
        assert time.monotonic() < deadline, f"remote prefill never came back: {info}"
        time.sleep(0.5)  # a request every half second until the cool-down ends
    while _health(d)["kv_transfer"] != "ok":
        assert time.monotonic() < deadline, _health(d)
        time.sleep(0.2)
    d.assert_no_leaks()

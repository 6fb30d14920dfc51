"""A cut Redis host. Redis runs on a host of its own and is the preferred KV backend (UCX
next): while its link is cut every prompt falls back to UCX and is answered with
transformers' text within its deadline, the prefill reports Redis unusable, and after the
heal Redis is probed again and carries prompts again. No block is left held."""
from __future__ import annotations

import itertools
import time

import pytest

from pdserve.lab.hosts import Lab
from pdserve.lab.services import deploy

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 8
ROUTER_ARGS = ["--local-prefill-threshold", "0", "--static-routing"]  # always ask the prefill host
COOLDOWN_S = 2.0  # between the background probes of an unhealthy store
WORKER_ARGS = ["--kv-backends", "redis,ucx", "--failure-policy", "recompute", "--num-threads", "1",
               "--max-kv-tokens", "4096", "--heartbeat-s", "0.5", "--kv-probe-cooldown-s", str(COOLDOWN_S)]
ANSWER_S = 30.0  # each prompt's deadline, cut or not
NUM_FAILURES_TO_UNHEALTHY = 3  # kvtransfer's failure_threshold


def test_a_cut_redis_host_falls_back_and_is_probed_again(lab_allowed, greedy, long_prompt, secret_file, start_redis):
    _, run = greedy
    short = long_prompt[: len(long_prompt) // 3]  # ~200 tokens: 13 blocks cross
    prompts = (f"Request {i}. {short}" for i in itertools.count())  # no prefix block shared
    with Lab(["router", "prefill", "decode", "redis"]) as lab:
        url = start_redis(lab, "redis")
        cluster = deploy(lab, secret_file, "router", ["prefill"], ["decode"], ROUTER_ARGS, WORKER_ARGS,
                         worker_env={"PDSERVE_REDIS_URL": url})

        def ask() -> dict:
            """One prompt, answered within ANSWER_S with transformers' text; its transfer verdict."""
            prompt = next(prompts)
            started = time.monotonic()
            out = cluster.request("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0}, timeout_s=ANSWER_S)
            took = time.monotonic() - started
            assert took < ANSWER_S and out["choices"][0]["text"] == run(prompt, MAX_TOKENS)
            print(f"netlab redis cut: answered in {took:.2f} s, verdict {out['pdserve']['transfer']}")
            return out["pdserve"]["transfer"]

        def prefill_redis_usable(expected: bool, timeout_s: float) -> bool:
            deadline = time.monotonic() + timeout_s
            while cluster.backends_usable().get(("prefill", "redis")) != expected:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.1)
            return True

        first = ask()
        assert first["backend"] == "redis" and first["fallbacks"] == [], first

        lab.cut("redis")
        for _ in range(NUM_FAILURES_TO_UNHEALTHY):  # each waits out the store's socket timeout
            verdict = ask()
            assert verdict["outcome"] == "transferred" and verdict["backend"] == "ucx", verdict
            assert [f["backend"] for f in verdict["fallbacks"]] == ["redis"], verdict
        assert prefill_redis_usable(False, 5.0), cluster.backends_usable()
        skipped = ask()  # unhealthy: not tried (no wait on its timeout), reported unusable while cut
        assert skipped["backend"] == "ucx", skipped
        assert all("unhealthy" in f["reason"] for f in skipped["fallbacks"]), skipped
        assert not prefill_redis_usable(True, 1.5 * COOLDOWN_S), "reported usable while the redis host is cut"

        lab.heal("redis")
        healed = time.monotonic()
        assert prefill_redis_usable(True, 3 * COOLDOWN_S), cluster.backends_usable()
        print(f"netlab redis cut: probed and usable again {time.monotonic() - healed:.1f} s after the heal")
        again = ask()
        assert again["backend"] == "redis" and again["fallbacks"] == [], again
        cluster.wait_idle()  # every block back in its pool on both hosts

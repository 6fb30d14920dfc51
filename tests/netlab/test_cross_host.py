"""Prefill and decode on separate hosts: the real role commands in three network namespaces,
a prompt's KV carried across the lab's switch by UCX over TCP or by gloo (the NCCL path on
CPU), or through a directory both hosts mount (the disk store)."""
from __future__ import annotations

import time

import pytest

from pdserve.lab.hosts import Lab
from pdserve.lab.services import deploy

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 16
ROUTER_ARGS = ["--local-prefill-threshold", "0", "--static-routing"]  # always ask the prefill host
WORKER_ARGS = ["--failure-policy", "fail", "--num-threads", "1", "--max-kv-tokens", "4096", "--heartbeat-s", "0.5"]
OVER_THE_LINK = ("ucx", "nccl")  # point to point: the KV's bytes cross the decode's link


@pytest.mark.parametrize("backend", ["ucx", "nccl", "disk"])
def test_a_long_prompt_crosses_hosts_and_its_kv_arrives(lab_allowed, greedy, long_prompt, secret_file, tmp_path,
                                                        backend):
    tok, run = greedy
    assert 550 <= len(tok(long_prompt).input_ids) <= 700
    with Lab(["router", "prefill", "decode"]) as lab:
        started = time.monotonic()
        kv = ["--kv-backends", backend] + (["--disk-store", str(tmp_path / "kv")] if backend == "disk" else [])
        cluster = deploy(lab, secret_file, "router", ["prefill"], ["decode"], ROUTER_ARGS, [*WORKER_ARGS, *kv])
        ready_s = time.monotonic() - started
        before = {name: lab.counters(name) for name in ("prefill", "decode")}
        started = time.monotonic()
        out = cluster.request("/v1/completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": MAX_TOKENS,
                                                  "temperature": 0})
        answer_s = time.monotonic() - started
        crossed = {name: lab.counters(name) - before[name] for name in before}
        transfer = out["pdserve"]["transfer"]
        print(f"\nnetlab: ready in {ready_s:.1f} s, answered in {answer_s:.2f} s; "
              f"{out['usage']['prompt_tokens']} prompt tokens; verdict {transfer}; eth0 {crossed}")
        assert transfer["outcome"] == "transferred" and transfer["backend"] == backend, transfer
        assert transfer["fallbacks"] == [], transfer
        if backend in OVER_THE_LINK:
            assert crossed["decode"].rx_bytes >= transfer["bytes"] > 0, (crossed, transfer)
            assert crossed["prefill"].tx_bytes >= transfer["bytes"], (crossed, transfer)
        assert out["choices"][0]["text"] == run(long_prompt, MAX_TOKENS)
        cluster.wait_idle()  # every block back in its pool on both hosts


def test_redis_on_a_host_of_its_own_carries_a_prompts_kv(lab_allowed, greedy, long_prompt, secret_file,
                                                          start_redis):
    """The store path across hosts: prefill puts the prompt's blocks into a Redis server on a
    fourth host, decode fetches them from there (its link receives them), and the text is
    transformers'."""
    _, run = greedy
    with Lab(["router", "prefill", "decode", "redis"]) as lab:
        url = start_redis(lab, "redis")
        kv = ["--kv-backends", "redis"]
        cluster = deploy(lab, secret_file, "router", ["prefill"], ["decode"], ROUTER_ARGS, [*WORKER_ARGS, *kv],
                         worker_env={"PDSERVE_REDIS_URL": url})
        before = lab.counters("decode")
        out = cluster.request("/v1/completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": MAX_TOKENS,
                                                  "temperature": 0})
        crossed = lab.counters("decode") - before
        transfer = out["pdserve"]["transfer"]
        print(f"\nnetlab redis: verdict {transfer}; decode eth0 {crossed}")
        assert transfer["outcome"] == "transferred" and transfer["backend"] == "redis", transfer
        assert crossed.rx_bytes >= transfer["bytes"] > 0, (crossed, transfer)  # fetched from the redis host
        assert out["choices"][0]["text"] == run(long_prompt, MAX_TOKENS)
        cluster.wait_idle()

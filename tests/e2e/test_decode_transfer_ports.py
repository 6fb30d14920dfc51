"""Issue 38 (3) against a real decode: with KV over nccl (gloo on CPU), an outsider that speaks
torch's TCPStore protocol to every port the decode listens on besides its gRPC port (the nccl
control listener and each pair's gloo device) cannot store a value or hold a connection there:
twelve 8 MB values per port, each cut off or never connected, the decode's memory and
descriptors as before, and the decode serves on: a new prompt's KV still arrives over nccl
(the policy is fail, so an answer means it did), a known prompt answers the same text, and every
KV block is back in its pool.
"""
from __future__ import annotations

import os
import time

import httpx
import pytest
from harness import MODEL, deploy_workers
from store_attack import NUM_VALUES, VALUE_BYTES, attack_all, listening_ports

pytestmark = pytest.mark.slow

PROMPTS = ("List the planets of the solar system in order from the sun:",
           "Name the seven continents of the world, largest first:")
SETTLE_S = 20.0


@pytest.fixture(scope="module")
def cluster():
    d = deploy_workers([("prefill-0", "prefill", []), ("decode-0", "decode", [])],
                       router_args=["--local-prefill-threshold", "0", "--static-routing"],
                       common=["--kv-backends", "nccl", "--failure-policy", "fail"])
    yield d
    from pdserve.deploy import up

    up.stop(d.children)


def complete(d, prompt: str) -> str:
    reply = httpx.post(f"{d.base_url}/completions", timeout=120,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def fds_and_rss_mib(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return len(os.listdir(f"/proc/{pid}/fd")), rss_kib // 1024


def test_an_outsider_on_every_decode_transfer_port_is_refused_and_the_decode_serves_on(cluster):
    d = cluster
    first = complete(d, PROMPTS[0])  # over nccl (the only backend; the policy is fail): a pair is up
    pid = d.child("decode-0").proc.pid
    grpc_port = int(d.worker_addresses("decode")["decode-0"].rsplit(":", 1)[1])
    ports = sorted(listening_ports(pid) - {grpc_port})
    assert len(ports) >= 2, f"the nccl listener and a pair's gloo device: {ports}"
    before = fds_and_rss_mib(pid)
    outcomes = attack_all(ports)
    assert all(seen <= {"cut off", "no connection"} for seen in outcomes.values()), outcomes
    deadline = time.monotonic() + SETTLE_S
    while (after := fds_and_rss_mib(pid))[0] > before[0]:
        assert time.monotonic() < deadline, f"connections kept: fds/RSS MiB {before} -> {after}"
        time.sleep(0.1)
    print(f"\ndecode transfer ports {outcomes}; fds/RSS MiB before {before}, after {after}")
    assert after[1] - before[1] < 64, (f"RSS {before[1]} -> {after[1]} MiB under "
                                       f"{NUM_VALUES} x {VALUE_BYTES >> 20} MB per port {outcomes}")
    assert complete(d, PROMPTS[1])  # a transfer on the pair made before the attack
    assert complete(d, PROMPTS[0]) == first
    d.assert_no_leaks()

"""Internal mutual TLS across hosts: every service holds a certificate of one CA naming its
host's address and nothing else (each side checks the other's address), a long prompt's KV
crosses from the prefill host to the decode host over UCX, and a decode whose certificate
names another address cannot register."""
from __future__ import annotations

import sys
import time

import pytest

from pdserve.lab.hosts import Lab
from pdserve.lab.services import deploy
from pdserve.router.config import ROUTER_REGISTRY_PORT
from pki import TestCA

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 16
ROUTER_ARGS = ["--local-prefill-threshold", "0", "--static-routing"]  # always ask the prefill host
WORKER_ARGS = ["--kv-backends", "ucx", "--failure-policy", "fail", "--num-threads", "1", "--max-kv-tokens", "4096",
               "--heartbeat-s", "0.5"]
ELSEWHERE = "10.77.0.99"  # an address no host of the lab has


def _wait_for_line(service, text: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [line for line in service.lines if text in line]
        if found:
            return found[0]
        assert service.proc.poll() is None, f"{service.name} exited:\n{service.tail()}"
        assert time.monotonic() < deadline, f"no {text!r} from {service.name} in {timeout_s:.0f} s:\n{service.tail()}"
        time.sleep(0.2)


def test_mutual_tls_with_certificates_naming_each_hosts_address(lab_allowed, greedy, long_prompt, secret_file,
                                                                 tmp_path):
    tok, run = greedy
    assert 550 <= len(tok(long_prompt).input_ids) <= 700
    ca = TestCA(tmp_path)
    py = [sys.executable, "-m", "pdserve.deploy.cli"]
    with Lab(["router", "prefill", "decode", "rogue"]) as lab:
        tls = {name: ca.issue(name, [lab[name].address]) for name in ("router", "prefill", "decode")}
        router = lab["router"].address
        rogue_tls = ca.issue("rogue", [ELSEWHERE])
        rogue = lab.start("rogue", "rogue", [*py, "decode", "--host", lab["rogue"].address, "--router",
                                             f"{router}:{ROUTER_REGISTRY_PORT}", "--worker-id", "rogue",
                                             "--cluster-secret-file", secret_file, *WORKER_ARGS, *rogue_tls.flags()],
                          {"PDSERVE_UCX_TLS": "tcp,self"})
        cluster = deploy(lab, secret_file, "router", ["prefill"], ["decode"], [*ROUTER_ARGS, *tls["router"].flags()],
                         WORKER_ARGS, per_host_args={n: tls[n].flags() for n in ("prefill", "decode")})
        before = lab.counters("decode")
        out = cluster.request("/v1/completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": MAX_TOKENS,
                                                  "temperature": 0})
        crossed = lab.counters("decode") - before
        transfer = out["pdserve"]["transfer"]
        print(f"\nnetlab mTLS: verdict {transfer}; decode eth0 {crossed}")
        assert transfer["outcome"] == "transferred" and transfer["backend"] == "ucx", transfer
        assert transfer["fallbacks"] == [], transfer
        assert crossed.rx_bytes >= transfer["bytes"] > 0, (crossed, transfer)
        assert out["choices"][0]["text"] == run(long_prompt, MAX_TOKENS)
        cluster.wait_idle()  # every block back in its pool on both hosts
        refusal = _wait_for_line(rogue, "register with router", 120)
        assert "UNAUTHENTICATED" in refusal and f"names {ELSEWHERE}, not {lab['rogue'].address}" in refusal, refusal
        assert cluster.request("/health", timeout_s=10)["decode_workers"] == 1


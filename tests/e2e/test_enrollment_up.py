"""Enrollment of one's own (issue 48, item 1), on real processes started as `pdserve up`
starts them: a decode launched by hand with nothing but the deployment's cluster secret file
(and a fresh worker id) is refused at Register and never routed to; a revoked worker is
removed and stays out; the deployment serves on."""
from __future__ import annotations

import sys

import httpx
import pytest
from harness import MODEL, READY_TIMEOUT_S, Deployment, pick_free_port, secret_file, spawn

from pdserve.deploy import up

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    revoked = tmp_path_factory.mktemp("revoked") / "revoked-workers"
    http_port, grpc_port, registry_port = pick_free_port(), pick_free_port(), pick_free_port()
    settings = {"http_port": http_port, "router_grpc_port": grpc_port, "router_registry_port": registry_port,
                "num_threads": 1, "num_decode": 2, "local_prefill": True, "cluster_secret_file": secret_file(),
                "revoked_workers_file": str(revoked)}
    children, port = up.start(settings)
    try:
        up.wait_ready(children, f"http://127.0.0.1:{port}", READY_TIMEOUT_S)
        deployment = Deployment(children, http_port, grpc_port, settings["cluster_secret_file"])
        deployment.registry_port, deployment.revoked = registry_port, revoked
        yield deployment
    finally:
        up.stop(children)


def _health(deployment: Deployment) -> dict:
    return httpx.get(f"{deployment.base_url.removesuffix('/v1')}/health", timeout=10).json()


def _chat(deployment: Deployment) -> dict:
    answer = httpx.post(f"{deployment.base_url}/chat/completions", timeout=120,
                        json={"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2,
                              "temperature": 0})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_rogue_decode_with_only_the_secret_is_refused(deployment: Deployment) -> None:
    rogue = up.Child("decode-rogue", [sys.executable, "-m", "pdserve.deploy.cli", "decode", "--host", "127.0.0.1",
                                      "--router", f"127.0.0.1:{deployment.registry_port}", "--grpc-port", "0",
                                      "--transfer-port", "0", "--num-threads", "1", "--kv-backends", "",
                                      "--free-memory-fraction", "0.05", "--worker-id", "decode-rogue",
                                      "--cluster-secret-file", deployment.secret_path])
    spawn(rogue)
    try:
        deployment.wait_until(lambda: any("register with router" in line and "UNAUTHENTICATED" in line
                                          and "enrollment token" in line for line in rogue.lines),
                              "the rogue decode's Register refused", READY_TIMEOUT_S)
        assert _health(deployment)["decode_workers"] == 2  # decode-0 and decode-1 only
        router = deployment.child("router").argv  # which holds no master secret to mint anything with
        with open(deployment.secret_path, "rb") as f:
            master = f.read().strip()
        with open(router[router.index("--cluster-secret-file") + 1], "rb") as f:
            assert master not in f.read()
        routed = {_chat(deployment)["pdserve"]["routing"]["decode_worker_id"] for _ in range(6)}
        assert "decode-rogue" not in routed
    finally:
        rogue.proc.kill()
        rogue.proc.wait(30)
    deployment.assert_no_leaks()


def test_a_revoked_worker_is_removed_and_stays_out(deployment: Deployment) -> None:
    decode_1 = deployment.child("decode-1")
    assert not any("UNAUTHENTICATED" in line for line in decode_1.lines)  # it was in good standing
    deployment.revoked.write_text("# revoked\ndecode-1\n")
    deployment.wait_until(lambda: _health(deployment)["decode_workers"] == 1, "decode-1 removed", 30)
    # its calls to the registry are refused from now on (its key is gone with its registration)
    deployment.wait_until(lambda: any("UNAUTHENTICATED" in line for line in decode_1.lines),
                          "decode-1's calls refused", 30)
    assert _health(deployment)["decode_workers"] == 1
    assert {_chat(deployment)["pdserve"]["routing"]["decode_worker_id"] for _ in range(3)} == {"decode-0"}

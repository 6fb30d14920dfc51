"""`pdserve up --api-keys-file`, real router, prefill and decode: two tenants share nothing
of the prefix cache (one's prompt, sent again by the other, reports cached_tokens 0, and by
its owner more than 0), a tenant over its requests per minute gets 429 with Retry-After,
and a key added to the file works without a restart. Every KV block is back afterwards."""
from __future__ import annotations

import os

import httpx
import pytest
from harness import MODEL, READY_TIMEOUT_S, Deployment, pick_free_port, secret_file

from pdserve.deploy import up

pytestmark = pytest.mark.slow

LONG = [{"role": "user", "content": "Recite the ledger: " + " ".join(
    f"crate {i} holds {i * 7} bolts." for i in range(14))}]


def _write_keys(path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o600)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    keys = tmp_path_factory.mktemp("tenants") / "api-keys"
    _write_keys(keys, "# tenant key\nacme key-acme\nglobex key-globex\nslow key-slow requests_per_minute=1\n")
    http_port, grpc_port, registry_port = pick_free_port(), pick_free_port(), pick_free_port()
    settings = {"http_port": http_port, "router_grpc_port": grpc_port, "router_registry_port": registry_port,
                "num_threads": 1, "cluster_secret_file": secret_file(), "api_keys_file": str(keys)}
    children, port = up.start(settings)
    try:
        up.wait_ready(children, f"http://127.0.0.1:{port}", READY_TIMEOUT_S, headers=up.client_headers(settings))
        deployment = Deployment(children, http_port, grpc_port, settings["cluster_secret_file"])
        deployment.keys_file = keys
        yield deployment
    finally:
        up.stop(children)


def _chat(deployment: Deployment, key: str, salt: str = "") -> httpx.Response:
    body = {"model": MODEL, "messages": LONG, "max_tokens": 2, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    return httpx.post(f"{deployment.base_url}/chat/completions", timeout=120, json=body,
                      headers={"Authorization": f"Bearer {key}"})


def _cached(answer: httpx.Response) -> int:
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_tenant_never_hits_another_tenants_prefix(deployment: Deployment) -> None:
    _cached(_chat(deployment, "key-acme"))
    assert _cached(_chat(deployment, "key-globex")) == 0  # globex's guess of acme's prompt
    assert _cached(_chat(deployment, "key-acme")) > 0  # acme's own prefix is cached
    assert _cached(_chat(deployment, "key-acme", salt="finer")) == 0  # cache_salt still separates
    deployment.assert_no_leaks()


def test_limits_answer_429_and_new_keys_work_without_restart(deployment: Deployment) -> None:
    assert _chat(deployment, "key-slow").status_code == 200
    refused = _chat(deployment, "key-slow")
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert _chat(deployment, "key-new").status_code == 401
    text = deployment.keys_file.read_text() + "initech key-new\n"
    _write_keys(deployment.keys_file, text)
    stamp = os.stat(deployment.keys_file).st_mtime_ns + 2_000_000_000
    os.utime(deployment.keys_file, ns=(stamp, stamp))
    deployment.wait_until(lambda: _chat(deployment, "key-new").status_code == 200, "the new key accepted", 30)
    deployment.assert_no_leaks()

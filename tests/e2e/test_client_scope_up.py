"""`pdserve up` with an API key and an admin key, real router, prefill and decode: it gets
ready (counting its workers on /health with the API key), a client's answer carries no
routing, transfer verdict or timings and anonymous /health only the status, the admin sees
them all; every KV block is back in its pool afterwards."""
from __future__ import annotations

import httpx
import pytest
from harness import MODEL, READY_TIMEOUT_S, Deployment, pick_free_port, secret_file

from pdserve.deploy import up

pytestmark = pytest.mark.slow

API_KEY = "client-key-e2e"
ADMIN_KEY = "admin-key-e2e"
# long enough that decode asks the prefill service (over --local-prefill-threshold tokens)
LONG = [{"role": "user", "content": "Summarise in one line: " + " ".join(
    f"the keeper checked lamp {i} at dusk." for i in range(10))}]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    admin_file = tmp_path_factory.mktemp("admin") / "admin-key"
    admin_file.write_text(ADMIN_KEY)
    admin_file.chmod(0o600)
    http_port, grpc_port, registry_port = pick_free_port(), pick_free_port(), pick_free_port()
    settings = {"http_port": http_port, "router_grpc_port": grpc_port, "router_registry_port": registry_port,
                "num_threads": 1, "cluster_secret_file": secret_file(), "api_key": API_KEY,
                "admin_api_key_file": str(admin_file)}
    children, port = up.start(settings)
    try:
        up.wait_ready(children, f"http://127.0.0.1:{port}", READY_TIMEOUT_S,
                      headers={"Authorization": f"Bearer {API_KEY}"})
        yield Deployment(children, http_port, grpc_port, settings["cluster_secret_file"])
    finally:
        up.stop(children)


def _chat(deployment: Deployment, key: str) -> dict:
    answer = httpx.post(f"{deployment.base_url}/chat/completions", timeout=120,
                        headers={"Authorization": f"Bearer {key}"},
                        json={"model": MODEL, "messages": LONG, "max_tokens": 4, "temperature": 0})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_client_sees_the_answer_and_the_admin_the_internals(deployment: Deployment) -> None:
    admin, client = _chat(deployment, ADMIN_KEY), _chat(deployment, API_KEY)
    assert client["choices"][0]["message"]["content"] == admin["choices"][0]["message"]["content"]
    assert set(client["pdserve"]) == {"request_id"}
    assert client["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the admin's prompt, as OpenAI says it
    assert admin["pdserve"]["routing"]["decode_worker_id"] == "decode-0"
    assert admin["pdserve"]["routing"]["prefill_worker_id"] == "prefill-0"
    assert admin["pdserve"]["transfer"]["outcome"] == "transferred" and admin["pdserve"]["timings"]["prefill_ms"] > 0
    health = f"{deployment.base_url.removesuffix('/v1')}/health"
    assert httpx.get(health, timeout=10).json() == {"status": "ok"}
    details = httpx.get(health, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10).json()
    assert (details["decode_workers"], details["prefill_workers"]) == (1, 1) and "kv_backends" in details
    deployment.assert_no_leaks()

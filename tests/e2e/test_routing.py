"""2 prefill + 2 decode services: a repeated long prefix goes to the decode service that
holds it (visible in routing reasons, metrics and cached tokens); round-robin prefill
routing spreads requests over both prefill services."""
from __future__ import annotations

import httpx
import pytest
from harness import MODEL, deploy_workers

pytestmark = pytest.mark.slow

SYSTEM = ("You are a meticulous assistant for a shipping company. " * 25).strip()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("kvstore"))
    common = ["--kv-backends", "disk", "--disk-store", store]
    workers = [(f"prefill-{i}", "prefill", []) for i in range(2)]
    workers += [(f"decode-{i}", "decode", []) for i in range(2)]
    d = deploy_workers(workers, router_args=["--decode-policy", "prefix_aware",
                                             "--prefill-policy", "round_robin",
                                             "--local-prefill-threshold", "0", "--static-routing"], common=common)
    yield d
    from pdserve.deploy import up

    up.stop(d.children)


def _chat(client, question: str):
    return client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


def test_repeated_prefix_goes_to_the_worker_that_holds_it(cluster):
    client = cluster.openai()
    first = _chat(client, "Where is parcel 1?")
    home = first.model_extra["pdserve"]["routing"]["decode_worker_id"]
    # no wait for a heartbeat: the decode's KV events tell the router within one batch
    for i in range(2, 6):
        reply = _chat(client, f"Where is parcel {i}?")
        routing = reply.model_extra["pdserve"]["routing"]
        assert routing["decode_worker_id"] == home, routing
        assert routing["decode_reason"] == "prefix_match", routing
        assert routing["matched_prefix_tokens"] >= 200, routing
        # the decode worker had the prefix: only the rest moved. Cached counts what the
        # prefill did not compute: the second prefill worker computed the prefix once (i = 2)
        cached = reply.usage.prompt_tokens_details.cached_tokens
        assert cached == 0 if i == 2 else cached >= 200, (i, cached)
        transfer = reply.model_extra["pdserve"]["transfer"]
        assert transfer["outcome"] == "transferred"
        assert transfer["blocks"] <= 3, transfer
    metrics = httpx.get(cluster.base_url.replace("/v1", "/metrics"), timeout=10).text
    assert 'reason="prefix_match"' in metrics
    cluster.assert_no_leaks()


def test_round_robin_spreads_prefills(cluster):
    client = cluster.openai()
    used = [_chat(client, f"Track order {i} please, it is urgent and important.")
            .model_extra["pdserve"]["routing"]["prefill_worker_id"] for i in range(4)]
    assert set(used) == {"prefill-0", "prefill-1"}, used
    cluster.assert_no_leaks()


def test_chats_sharing_only_the_template_prefix_spread_over_both_decodes(cluster):
    """Every chat shares the chat template's first block; that is not worth affinity, so 20
    chats in a row split within 40/60 between the two decode services (prefix_aware is the
    router's default policy, as under `pdserve up --num-decode 2`)."""
    client = cluster.openai()
    counts: dict[str, int] = {}
    for i in range(20):
        chat = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                              messages=[{"role": "user", "content": f"Name a color, {i}."}])
        routing = chat.model_extra["pdserve"]["routing"]
        assert routing["decode_reason"] in ("no_prefix_match", "short_prefix_match"), routing
        counts[routing["decode_worker_id"]] = counts.get(routing["decode_worker_id"], 0) + 1
    assert sorted(counts) == ["decode-0", "decode-1"] and all(8 <= n <= 12 for n in counts.values()), counts
    cluster.assert_no_leaks()

"""Issue 46's "Done when" for KV events, on real processes: a router restarted while two
decode services hold chats routes a returning chat to the decode holding its history, as
soon as that decode's event stream has told it (its next batch makes the decode register
again, the registration brings a snapshot)."""
from __future__ import annotations

import time

import pytest
from harness import MODEL, deploy_workers, spawn

from pdserve.deploy import up

pytestmark = pytest.mark.slow

SYSTEM = ("You are a meticulous assistant for a shipping company. " * 25).strip()


@pytest.fixture(scope="module")
def cluster():
    workers = [(f"decode-{i}", "decode", []) for i in range(2)]
    # heartbeats as the router asks by default (every 2 s), not the harness's 0.5 s
    d = deploy_workers(workers, router_args=["--decode-policy", "prefix_aware"], common=["--heartbeat-s", "30"])
    yield d
    up.stop(d.children)


def _indexed(cluster, worker_id: str) -> float:
    return cluster.metric(f'pdserve_router_kv_index_blocks{{tier="device",worker_id="{worker_id}"}}')


def test_a_restarted_router_routes_a_returning_chat_to_its_holder_at_once(cluster):
    client = cluster.openai()
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is parcel 1?"}]
    first = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=8, temperature=0, user="chat-1")
    holder = first.model_extra["pdserve"]["routing"]["decode_worker_id"]
    history_blocks = first.usage.prompt_tokens // 16
    cluster.wait_until(lambda: _indexed(cluster, holder) >= history_blocks, "the first turn's blocks indexed")

    router = cluster.child("router")
    up.stop([router])
    spawn(router)
    assert router.ready.wait(120), "the router did not come back"
    back = time.monotonic()
    cluster.wait_until(lambda: _indexed(cluster, holder) >= history_blocks, "the holder's blocks, after the restart",
                       timeout_s=30)
    learned_s = time.monotonic() - back
    print(f"restarted router knew {holder}'s blocks {learned_s:.2f} s after it was ready")

    chat += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And parcel 2?"}]
    second = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=8, temperature=0, user="chat-1")
    routing = second.model_extra["pdserve"]["routing"]
    assert (routing["decode_worker_id"], routing["decode_reason"]) == (holder, "prefix_match"), routing
    assert routing["matched_prefix_tokens"] >= history_blocks * 16, routing
    assert second.usage.prompt_tokens_details.cached_tokens >= history_blocks * 16
    # the decodes register again on their event stream's answer (the new router does not know
    # their keys): a heartbeat could do it too, every 2 s, so time alone proves little here;
    # tests/integration/test_kv_events.py proves it with heartbeats 20 s apart
    assert learned_s < 5.0, learned_s
    cluster.assert_no_leaks()

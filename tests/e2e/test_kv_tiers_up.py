"""Chats that come back after their history left the KV pool (`pdserve up --local-prefill
--max-kv-tokens ... --kv-offload-host-gb ...`): two chats take turns, so each one's history
is evicted from the small pool between its turns. Each turn finds its whole history (the
previous prompt and answer, less the last partial block) in the pool or the host tier; the
text is transformers' greedy text; the router counts the host tier's tokens; no block is
left held."""
from __future__ import annotations

import pytest
from harness import MODEL, deploy

pytestmark = pytest.mark.slow

BLOCK = 16
ANSWER_TOKENS = 16
TOPICS = ("lighthouses", "volcanoes")


def system_message(topic: str) -> str:
    return (f"You are a patient guide who explains {topic} to curious visitors. " * 6).strip()


@pytest.fixture(scope="module")
def tiered():
    d = deploy(local_prefill=True, max_kv_tokens=192, kv_offload_host_gb=0.1)
    yield d
    from pdserve.deploy import up

    up.stop(d.children)


def test_each_turn_finds_its_whole_history(tiered, hf_reference):
    _, greedy = hf_reference
    client = tiered.openai()
    chats = {t: [{"role": "system", "content": system_message(t)}] for t in TOPICS}
    last_history: dict[str, int] = {}
    host_tokens = 0
    for turn in range(2):
        for topic, messages in chats.items():
            messages.append({"role": "user", "content": f"Tell me fact number {turn + 1} about {topic}."})
            out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=ANSWER_TOKENS,
                                                 temperature=0, user=topic)
            text = out.choices[0].message.content
            assert text == greedy(messages, ANSWER_TOKENS)
            cached = out.usage.prompt_tokens_details.cached_tokens
            if topic in last_history:
                assert cached >= last_history[topic] - BLOCK, (topic, turn, cached, last_history[topic])
            by_tier = out.model_extra["pdserve"].get("cached_tokens_by_tier", {})
            assert sum(by_tier.values()) == cached
            host_tokens += by_tier.get("host", 0)
            last_history[topic] = out.usage.prompt_tokens + out.usage.completion_tokens
            messages.append({"role": "assistant", "content": text})
    assert host_tokens > 0  # some history came back from the host tier, not from the pool
    assert tiered.metric('pdserve_router_cached_prompt_tokens_by_tier_total{tier="host"}') == host_tokens
    tiered.assert_no_leaks()

"""A decode service with `--speculative-config` behind the router, its prompts computed by a
prefill service: copy-heavy and plain chats get transformers' greedy text, streamed or
whole; the usage reports the drafts checked, the router's metrics count them, and every block
is back afterwards."""
from __future__ import annotations

import httpx
import pytest
from harness import MODEL, deploy_workers

pytestmark = pytest.mark.slow

NGRAM = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'
TEXT = ("Chen bought a silver watch in Osaka on day 9. Bruno bought a wooden chair in Riga on day 16. "
        "Goran bought an old violin in Quito on day 20. Alice bought a wooden chair in Lima on day 14.")
COPY = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{TEXT}"}]
PLAIN = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def cluster():
    d = deploy_workers([("prefill-0", "prefill", []), ("decode-0", "decode", ["--speculative-config", NGRAM])])
    yield d
    from pdserve.deploy import up

    up.stop(d.children)


def test_copy_and_plain_chats_equal_transformers_with_drafts_reported(cluster, hf_reference):
    _, greedy = hf_reference
    client = cluster.openai()
    copy = client.chat.completions.create(model=MODEL, messages=COPY, max_tokens=48, temperature=0)
    assert copy.choices[0].message.content == greedy(COPY, 48)
    details = copy.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= copy.usage.completion_tokens // 3, copy.usage
    assert details.rejected_prediction_tokens >= 0
    assert copy.model_extra["pdserve"]["transfer"]["outcome"] == "transferred"

    chunks = client.chat.completions.create(model=MODEL, messages=COPY, max_tokens=48, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(parts) == greedy(COPY, 48)
    assert len(parts) < usage.completion_tokens  # steps gave several tokens at once

    plain = client.chat.completions.create(model=MODEL, messages=PLAIN, max_tokens=24, temperature=0)
    assert plain.choices[0].message.content == greedy(PLAIN, 24)
    cluster.assert_no_leaks()

    metrics = httpx.get(f"{cluster.base_url.removesuffix('/v1')}/metrics", timeout=10).text
    accepted = [line for line in metrics.splitlines()
                if line.startswith('pdserve_router_draft_tokens_total{outcome="accepted"}')]
    assert accepted and float(accepted[0].split()[-1]) >= details.accepted_prediction_tokens
    assert any(line.startswith("pdserve_router_draft_steps_total ") for line in metrics.splitlines())

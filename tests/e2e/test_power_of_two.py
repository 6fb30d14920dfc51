"""Router with --decode-policy power_of_two over 3 real decode services: 40 concurrent chats
spread within 40/60 of even (every decode within 20 % of its even share), each routed with
the reason "power_of_two"; every block back afterwards."""
from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor

import pytest
from harness import MODEL, deploy_workers

pytestmark = pytest.mark.slow

NUM_DECODES = 3
NUM_REQUESTS = 40


@pytest.fixture(scope="module")
def cluster():
    workers = [(f"decode-{i}", "decode", []) for i in range(NUM_DECODES)]
    d = deploy_workers(workers, router_args=["--decode-policy", "power_of_two", "--max-queue", "64"],
                       common=["--max-kv-tokens", "8192"])
    yield d
    from pdserve.deploy import up

    up.stop(d.children)


def test_power_of_two_spreads_40_concurrent_requests_over_3_decodes(cluster):
    client = cluster.openai()

    def ask(i: int) -> dict:
        reply = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                               messages=[{"role": "user", "content": f"Say a word about {i}."}])
        return reply.model_extra["pdserve"]["routing"]

    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        routings = list(pool.map(ask, range(NUM_REQUESTS)))
    assert {r["decode_reason"] for r in routings} == {"power_of_two"}
    counts = collections.Counter(r["decode_worker_id"] for r in routings)
    print(f"power_of_two over {NUM_DECODES} decodes: {dict(sorted(counts.items()))}")
    even = NUM_REQUESTS / NUM_DECODES
    assert len(counts) == NUM_DECODES and all(0.8 * even <= n <= 1.2 * even for n in counts.values()), counts
    cluster.assert_no_leaks()

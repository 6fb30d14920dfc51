"""Router with --decode-policy power_of_two over 3 real decode services: 40 concurrent chats
spread within 40/60 of even (every decode within 20 % of its even share), each routed with
the reason "power_of_two"; every block back afterwards.

Each chat generates 24 tokens, so all 40 are still in flight while the last is routed: the
router then knows every decode's load, and two choices out of three keep the spread tight.
With 2-token chats most were routed to idle decodes, where the policy is a coin toss and
40 tosses over 3 fall outside 20 % about one run in three."""
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
        reply = client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0,
                                               extra_body={"ignore_eos": True},
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

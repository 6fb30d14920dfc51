"""Removing workers under load loses nothing: a decode and a prefill told to stop (SIGTERM, as
the planner's scalers and Kubernetes do) while streams run on them announce that they are
draining, the router sends them nothing new, they finish what they have, and exit. Every
request completes with transformers' greedy text, none migrates, and every KV block is back
in its pool on every worker (the drained ones report theirs as they leave)."""
from __future__ import annotations

import re
import signal
import threading

import pytest
from harness import MODEL, deploy_workers

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
PROMPTS = [[{"role": "user", "content": f"In two sentences, what is special about the number {n}?"}]
           for n in range(6)]


@pytest.fixture(scope="module")
def cluster():
    drain = ["--drain-timeout-s", "60"]
    workers = [("prefill-0", "prefill", []), ("prefill-1", "prefill", drain),
               ("decode-0", "decode", []), ("decode-1", "decode", drain)]
    d = deploy_workers(workers, router_args=["--decode-policy", "round_robin", "--prefill-policy", "round_robin",
                                             "--local-prefill-threshold", "0", "--static-routing", "--worker-timeout-s", "5"])
    yield d
    from pdserve.deploy import up

    up.stop(d.children)


def _chat(client, messages, out: dict, key) -> None:
    try:
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True)
        text, workers = "", set()
        for chunk in stream:
            extra = (chunk.model_extra or {}).get("pdserve") or {}
            if extra.get("routing", {}).get("decode_worker_id"):
                workers.add(extra["routing"]["decode_worker_id"])
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        out[key] = (text, workers)
    except Exception as exc:  # noqa: BLE001 - the assertion names it
        out[key] = (exc, set())


def test_draining_a_decode_and_a_prefill_under_load_loses_nothing(cluster, hf_reference):
    _, greedy = hf_reference
    client = cluster.openai()
    results: dict = {}
    first = [threading.Thread(target=_chat, args=(client, p, results, i)) for i, p in enumerate(PROMPTS)]
    for t in first:
        t.start()
    cluster.wait_until(lambda: cluster.load("decode-1").num_running > 0, "streams running on decode-1", 120)
    for name in ("decode-1", "prefill-1"):
        cluster.child(name).proc.send_signal(signal.SIGTERM)
    # the router hears of the drain at once: a request sent now goes to decode-0 only
    cluster.wait_until(lambda: cluster.metric('pdserve_router_workers{role="decode",state="draining"}') == 1
                       or cluster.child("decode-1").proc.poll() is not None, "decode-1 reported draining", 30)
    later = [threading.Thread(target=_chat, args=(client, p, results, 10 + i)) for i, p in enumerate(PROMPTS[:2])]
    for t in later:
        t.start()
    for t in first + later:
        t.join(300)
    for key, (text, workers) in sorted(results.items()):
        messages = PROMPTS[key % 10]
        assert text == greedy(messages, MAX_TOKENS), (key, text)
        if key >= 10:
            assert workers == {"decode-0"}, (key, workers)
    assert len(results) == len(PROMPTS) + 2
    for name in ("decode-1", "prefill-1"):
        child = cluster.child(name)
        assert child.proc.wait(30) == 0, "\n".join(child.lines[-20:])
        log = "\n".join(child.lines)
        assert "drained in" in log, log[-2000:]
        free, total = map(int, re.search(r"drained; (\d+) of (\d+) KV blocks free", log).groups())
        assert free == total
    assert cluster.metric('pdserve_router_migrations_total{outcome="migrated"}') == 0
    assert cluster.metric('pdserve_router_requests_total{api="http_chat",outcome="ok"}') >= len(PROMPTS) + 2
    cluster.assert_no_leaks()

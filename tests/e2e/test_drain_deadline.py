"""A drain whose deadline passes with a stream still open loses nothing either: the decode
deregisters, the router migrates the stream to another decode (prompt plus the tokens already
sent), and the client's text is transformers' greedy text, with no gap and no repeat."""
from __future__ import annotations

import signal

import pytest
from harness import deploy_workers, stream_and_disrupt

pytestmark = [pytest.mark.slow]

CHAT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]
MAX_TOKENS = 200  # long enough that the stream is still open when the drain starts, under load too


@pytest.fixture(scope="module")
def cluster():
    workers = [("decode-0", "decode", ["--drain-timeout-s", "0.5"]), ("decode-1", "decode", ["--drain-timeout-s", "0.5"])]
    d = deploy_workers(workers, router_args=["--decode-policy", "round_robin", "--worker-timeout-s", "5"])
    yield d
    from pdserve.deploy import up

    up.stop(d.children)


def test_a_stream_past_the_drain_deadline_migrates_and_text_is_exact(cluster, hf_reference):
    _, greedy = hf_reference
    stopped = []

    def drain(worker: str) -> None:
        cluster.child(worker).proc.send_signal(signal.SIGTERM)
        stopped.append(worker)

    text, worker, _ = stream_and_disrupt(cluster.openai(), CHAT, MAX_TOKENS, drain)
    assert text == greedy(CHAT, MAX_TOKENS)
    child = cluster.child(worker)
    assert child.proc.wait(15) == 0, "\n".join(child.lines[-20:])
    assert "drain deadline" in "\n".join(child.lines)
    assert cluster.metric('pdserve_router_migrations_total{outcome="migrated"}') == 1
    cluster.assert_no_leaks()

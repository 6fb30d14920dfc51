"""A decode service lost mid-stream, on real processes: killed outright, or frozen (SIGSTOP)
so that it neither answers nor closes its connections. The router hands the request to
another decode, which continues after the tokens already streamed: the client sees one
uninterrupted stream whose text is transformers' greedy text."""
from __future__ import annotations

import signal

import pytest
from harness import MODEL, deploy_workers, stream_and_disrupt

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]
MAX_TOKENS = 40
IDLE_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def cluster():
    workers = [(f"decode-{i}", "decode", []) for i in range(3)]
    d = deploy_workers(workers, router_args=["--decode-policy", "round_robin", "--worker-timeout-s", "3",
                                             "--stream-idle-timeout-s", str(IDLE_TIMEOUT_S)])
    yield d
    from pdserve.deploy import up

    up.stop(d.children)  # a frozen decode is continued, so it stops too


def _stream_and_disrupt(cluster, signum) -> tuple[str, str, float]:
    """One greedy chat; the decode serving it gets `signum` after the third content chunk.
    Its timings are checked (`_assert_migrated_timings`)."""
    seen: list[dict] = []
    text, worker, longest = stream_and_disrupt(cluster.openai(), CHAT, MAX_TOKENS,
                                               lambda worker: cluster.child(worker).proc.send_signal(signum), seen)
    # a frozen decode is cut off only by the registry (3 s without heartbeats) or the deadline
    min_stall_ms = 2000 if signum == signal.SIGSTOP else 0
    _assert_migrated_timings([extra["timings"] for extra in seen if "timings" in extra], longest, min_stall_ms)
    return text, worker, longest


def _assert_migrated_timings(timings: list[dict], longest_gap_s: float, min_stall_ms: float) -> None:
    """The first chunk's TTFT phases stand at the end; the move is counted, its stall is one
    gap the client saw, and the new decode's recompute of prompt and sent tokens is prefill
    work within that stall."""
    first, last = timings[0], timings[-1]
    assert first["prefill_ms"] > 0 and first["first_decode_ms"] > 0, first
    assert {phase: last[phase] for phase in first} == first, (first, last)
    assert last["migrations"] == 1, last
    assert 0 < last["resume_prefill_ms"] <= last["migration_ms"], last
    assert min_stall_ms <= last["migration_ms"] <= longest_gap_s * 1000 + 1000, (last, longest_gap_s)


def test_killed_then_frozen_decode_the_stream_migrates_and_text_is_exact(cluster, hf_reference):
    _, greedy = hf_reference
    expected = greedy(CHAT, MAX_TOKENS)

    killed_text, killed, _ = _stream_and_disrupt(cluster, signal.SIGKILL)
    assert killed_text == expected
    assert cluster.child(killed).proc.wait(10) is not None

    frozen_text, frozen, longest = _stream_and_disrupt(cluster, signal.SIGSTOP)
    assert frozen != killed
    assert frozen_text == expected
    # cut off by the inactivity deadline or the registry's verdict, whichever came first
    assert longest < IDLE_TIMEOUT_S + 6, longest

    # the one decode left serves on; once thawed, the frozen one frees what it held
    chat = cluster.openai().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == greedy(CHAT, 8)
    cluster.child(frozen).proc.send_signal(signal.SIGCONT)
    cluster.assert_no_leaks(timeout_s=30)
    metrics = cluster.openai()._client.get(f"http://127.0.0.1:{cluster.http_port}/metrics").text
    assert 'pdserve_router_migrations_total{outcome="migrated"} 2.0' in metrics, metrics

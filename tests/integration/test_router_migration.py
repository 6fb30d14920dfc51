"""Lost and failing workers: dead decodes are not routed to, lost streams migrate and continue,
worker errors reach the client.
Real router listeners on 127.0.0.1, in-test workers (`router_fakes`)."""
from __future__ import annotations

import json
import time
from typing import Any

import grpc
import httpx
import pytest

from pdserve.proto.pdserve.v1 import common_pb2
from pdserve.router.config import Role

from router_fakes import MODEL, WAIT_S, Cluster, Script, chat_body, wait_until


def test_dead_worker_is_not_routed_to(make_cluster):
    cluster = make_cluster(decode_policy="round_robin")
    alive, dead = cluster.add("d0"), cluster.add("d1")
    cluster.loop.run(dead.kill())
    served_by = []
    for _ in range(4):  # at once: the failed call marks d1 suspect and the request moves on
        chat = cluster.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=2)
        assert chat.choices[0].message.content == "Hello,"
        served_by.append(chat.model_extra["pdserve"]["routing"]["decode_worker_id"])
    assert served_by == ["d0"] * 4 and len(alive.requests) == 4
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        assert http.get("/health").json()["decode_workers"] == 1
        wait_until(lambda: 'pdserve_router_workers{role="decode",state="dead"} 1.0' in http.get("/metrics").text,
                   "d1 declared dead by heartbeat timeout")


def _stream_chat(cluster: "Cluster", **extra: Any) -> list[str]:
    """The SSE data lines of one streamed chat (keep-alives never show)."""
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        with http.stream("POST", "/v1/chat/completions", json=chat_body(stream=True, **extra)) as streamed:
            return [line.removeprefix("data: ") for line in streamed.iter_lines() if line]


def _contents(events: list[str]) -> str:
    return "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events
                   if e != "[DONE]" and "choices" in json.loads(e) and json.loads(e)["choices"])


@pytest.mark.parametrize("how", ["dies", "hangs", "declared_dead"])
def test_a_stream_whose_decode_is_lost_migrates_and_continues(make_cluster, how):
    """The decode serving a stream dies (UNAVAILABLE), hangs (silent past the inactivity
    deadline) or stops heartbeating (declared dead by the registry, the stream still open):
    the router resubmits to the other decode with the tokens already sent; the client sees
    every piece once, in order, and the usage of the whole answer. The timings stay those of
    the first token (d0's), plus the stall the move cost and d1's recompute within it."""
    idle_s = 0.6 if how == "hangs" else WAIT_S  # declared_dead: cut off by the registry, not the deadline
    cluster = make_cluster(decode_policy="round_robin", stream_idle_timeout_s=idle_s, worker_timeout_s=1.0)
    first_token = common_pb2.RequestTimings(queue_ms=1.0, prefill_ms=50.0, transfer_ms=2.0, first_decode_ms=3.0)
    first_script = {"dies": Script(fail_after=2, fail_code=grpc.StatusCode.UNAVAILABLE, timings=first_token),
                    "hangs": Script(hold_after=2, timings=first_token),
                    "declared_dead": Script(hold_after=2, timings=first_token)}[how]
    d0 = cluster.add("d0", script=first_script)
    d1 = cluster.add("d1", script=Script(timings=common_pb2.RequestTimings(queue_ms=9.0, prefill_ms=40.0,
                                                                           first_decode_ms=7.0)))
    if how == "declared_dead":
        cluster.loop.run(d0.client.stop(deregister=False))  # heartbeats stop; its server keeps the stream open
    started = time.monotonic()
    events = _stream_chat(cluster, stream_options={"include_usage": True})
    assert _contents(events) == "Hello, world!" and events[-1] == "[DONE]"
    assert all("error" not in json.loads(e) for e in events[:-1])
    assert list(d1.requests[-1].resumed_token_ids) == [100, 101]
    assert d1.requests[-1].prompt_token_ids == d0.requests[-1].prompt_token_ids
    assert not d1.requests[-1].prefill.address and d1.requests[-1].prefill.reason == "migrated"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 4
    assert cluster.metric("pdserve_router_migrations_total", outcome="migrated") == 1
    _assert_migrated_timings(events, time.monotonic() - started, min_stall_ms=idle_s * 1000 if how == "hangs" else 0)
    # the router's TTFT phases are the first token's
    assert cluster.metric("pdserve_router_ttft_phase_seconds_sum", phase="prefill") == pytest.approx(0.05)
    if how == "hangs":  # and the stall is one inter-token gap, as the client saw it
        assert cluster.metric("pdserve_router_inter_token_latency_seconds_count") == 3
        assert cluster.metric("pdserve_router_inter_token_latency_seconds_sum") >= idle_s
    if how != "dies":
        assert time.monotonic() - started < WAIT_S / 2  # not held for the abort's or worker's WAIT_S
        wait_until(lambda: d0.aborts == [d0.requests[0].request_id], "the lost stream aborted on d0")


def _assert_migrated_timings(events: list[str], elapsed_s: float, min_stall_ms: float) -> None:
    """The first chunk's phases are d0's first token's; the last chunk's too, with one move:
    its stall (at least `min_stall_ms`, within the request's time) and d1's recompute."""
    extras = [json.loads(e).get("pdserve", {}) for e in events[:-1]]
    timings = [extra["timings"] for extra in extras if "timings" in extra]
    first_token = {"queue_ms": 1.0, "prefill_ms": 50.0, "transfer_ms": 2.0, "first_decode_ms": 3.0}
    assert len(timings) == 2 and timings[0] == first_token  # d1's own phases never show: no TTFT
    last = timings[-1]
    assert {k: last[k] for k in first_token} == first_token, last
    assert last["migrations"] == 1 and last["resume_prefill_ms"] == 40.0, last
    assert min_stall_ms <= last["migration_ms"] <= elapsed_s * 1000, last


def test_a_lost_stream_with_nowhere_to_go_ends_with_a_clear_error(make_cluster):
    """No other decode (or no migrations allowed): an error event, then [DONE]; the lost
    worker is not used again until it heartbeats."""
    cluster = make_cluster(stream_idle_timeout_s=0.6, max_migrations=1)
    cluster.add("d0", script=Script(hold_after=2))
    events = _stream_chat(cluster)
    assert _contents(events) == "Hello,"
    error = json.loads(events[-2])["error"]
    assert events[-1] == "[DONE]" and "no decode worker" in error["message"]
    cluster.workers["d0"].script = Script()
    wait_until(lambda: cluster.router.registry.routable(Role.DECODE, MODEL), "d0 routable after its heartbeat")
    assert _contents(_stream_chat(cluster)) == "Hello, world!"

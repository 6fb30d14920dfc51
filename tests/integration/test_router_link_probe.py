"""A link priced out of use is probed again: with a decode reporting a slow link from the
prefill worker, long prompts stay local ("predicted_faster_local"), and once the link's
measurement is older than --link-probe-interval-s one prompt goes over it ("link_probe", in
the response's routing and in the request the decode gets), the next stays local.
Real router listeners on 127.0.0.1, in-test workers (`router_fakes`)."""
from __future__ import annotations

import time

from pdserve.proto.pdserve.v1 import common_pb2, registry_pb2

from router_fakes import MODEL, WAIT_S, words

SLOW_LINK = common_pb2.EngineCounters(received=[common_pb2.PeerTransferCounters(
    peer="p0", transfers=3, bytes_per_block=2**20, bytes_per_s=2**20, tail_s=1.0)])  # 1 MiB/s


def test_a_slow_link_gets_one_prompt_per_probe_interval(make_cluster):
    cluster = make_cluster(link_probe_interval_s=2.0)
    cluster.add("p0", role=registry_pb2.WORKER_ROLE_PREFILL,
                report=common_pb2.WorkerLoad(num_free_blocks=64, num_total_blocks=64, prefill_tokens_per_s=2000.0))
    d0 = cluster.add("d0", report=common_pb2.WorkerLoad(num_free_blocks=64, num_total_blocks=64,
                                                          prefill_tokens_per_s=1600.0, counters=SLOW_LINK))
    client = cluster.openai()

    def route(i: int) -> str:  # no two prompts share a block: none is short for a cached prefix
        chat = client.chat.completions.create(model=MODEL, max_tokens=2,
                                              messages=[{"role": "user", "content": words(24, start=i % 170)}])
        return chat.model_extra["pdserve"]["routing"]["prefill_reason"]

    assert route(0) == "predicted_faster_local"  # its measurement's age starts here
    reasons, deadline = [], time.monotonic() + WAIT_S
    while "link_probe" not in reasons:
        assert time.monotonic() < deadline, reasons
        reasons.append(route(len(reasons) + 1))
    assert set(reasons[:-1]) <= {"predicted_faster_local"}
    probe = d0.requests[-1]
    assert probe.prefill.reason == "link_probe" and probe.prefill.worker_id == "p0"
    assert route(len(reasons) + 1) == "predicted_faster_local"  # one probe per interval
    assert cluster.metric("pdserve_router_routing_decisions_total", pool="prefill", policy="least_loaded",
                          reason="link_probe") == 1

"""The TTFT phases a decode reports: a prompt whose KV arrived from a prefill service spends
its leg in `prefill_ms`; one recomputed here after its leg failed spends the failed leg and
the recompute there too, never in `first_decode_ms`."""
from __future__ import annotations

import time

from pdserve.decode.session import DecodeSessions
from pdserve.engine.outputs import RequestOutput
from pdserve.proto.pdserve.v1 import common_pb2
from pdserve.worker.metrics import WorkerMetrics


def first_delta(first_token_time: float) -> RequestOutput:
    return RequestOutput("r", (5,), "x", (), False, None, None, 10, 1, 0, 0,
                         first_scheduled_time=first_token_time - 0.5, first_token_time=first_token_time)


def phases(remote: bool, transferred: bool, t_arrival: float, sampled: float) -> common_pb2.RequestTimings:
    timings = common_pb2.RequestTimings(queue_ms=100.0)
    if remote:
        timings.prefill_ms, timings.transfer_ms = 2000.0, 5.0  # what the leg set: admission to its end
    sessions = DecodeSessions(loop=None, remote=None, metrics=WorkerMetrics("decode"))
    sessions._time_first_token(timings, first_delta(sampled), t_arrival, remote, transferred)
    return timings


def test_a_recomputed_prompt_counts_the_failed_leg_and_the_recompute_as_prefill():
    now = time.monotonic()
    t_arrival, sampled = now - 10.0, now - 0.2  # queued 0.1 s, first token 9.8 s after arrival
    recomputed = phases(remote=True, transferred=False, t_arrival=t_arrival, sampled=sampled)
    assert abs(recomputed.prefill_ms - 9700.0) < 50 and recomputed.first_decode_ms < 250
    transferred = phases(remote=True, transferred=True, t_arrival=t_arrival, sampled=sampled)
    assert transferred.prefill_ms == 2000.0 and transferred.first_decode_ms > 7000  # the leg's own time stands
    local = phases(remote=False, transferred=False, t_arrival=t_arrival, sampled=sampled)
    assert abs(local.prefill_ms - 500.0) < 1 and local.first_decode_ms < 250

"""The prefill runner's checks before any work: a hand-off whose blocks no KV backend could
carry is answered at once as skipped, with the sender's reasons, and nothing is computed."""
from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from pdserve.common.block_hash import prompt_blocks
from pdserve.prefill.runner import PrefillRunner
from pdserve.proto.pdserve.v1 import common_pb2, prefill_pb2
from pdserve.worker.metrics import WorkerMetrics


class Engine:
    compat_hash = 7

    def prompt_blocks(self, token_ids, cache_salt=""):  # LLMEngine.prompt_blocks, 16-token blocks
        return prompt_blocks(token_ids, 16, self.compat_hash, cache_salt=cache_salt)


class NeverRunLoop:
    """An engine loop that must not be asked to compute."""

    engine = Engine()

    async def add_request(self, *args, **kwargs):
        raise AssertionError("the prompt was computed although its KV could go nowhere")


class DownSends:
    """The transfer layer's send side (a `SendControl`) with every backend in its cool-down."""

    def unusable(self, params):
        from pdserve.kvtransfer.verdict import Fallback

        return [Fallback("redis", "unhealthy after 3 failures in a row (last: connection refused)")]

    def connect_ahead(self, params):
        raise AssertionError("connected ahead for a hand-off whose KV could go nowhere")

    def wait_verdict(self, request_id, timeout_s):
        raise AssertionError("waited for a send that never started")

    def abort_send(self, request_id):
        return False


def handoff() -> prefill_pb2.KVHandoff:
    return prefill_pb2.KVHandoff(transfer_id="ab" * 16, compatibility_hash=7, block_ids=[1, 2],
                                 backends=["redis", "recompute"], deadline_unix_ms=int(time.time() * 1000) + 30_000)


async def test_no_usable_backend_answers_skipped_without_computing():
    metrics = WorkerMetrics("prefill")
    runner = PrefillRunner(NeverRunLoop(), DownSends(), metrics, block_size=16, max_queue=4)
    request = prefill_pb2.PrefillRequest(request_id="r1", prompt_token_ids=list(range(20)),
                                         sampling=common_pb2.SamplingParams(max_tokens=4), handoff=handoff())
    response = await runner.run(request)
    assert response.skipped and response.request_id == "r1"
    assert response.verdict.outcome == common_pb2.TRANSFER_OUTCOME_FAILED
    assert response.verdict.reason.startswith("no_usable_kv_backend: redis: unhealthy after 3 failures")
    assert [f.backend for f in response.verdict.fallbacks] == ["redis"]
    assert runner.num_inflight == 0
    assert metrics.registry.get_sample_value("pdserve_worker_requests_total",
                                             {"outcome": "SKIPPED_NO_USABLE_BACKEND"}) == 1


def test_the_handoff_ledger_accepts_each_once_until_its_deadline_and_stays_bounded():
    import pytest

    from pdserve.common.errors import OverloadedError
    from pdserve.security.handoffs import HandoffLedger, ReplayedHandoffError
    from support import FakeClock

    clock = FakeClock(1000.0)
    ledger = HandoffLedger(max_remembered=2, clock=clock)
    ledger.accept("t1", 1010.0)
    with pytest.raises(ReplayedHandoffError, match="already used"):
        ledger.accept("t1", 1010.0)
    ledger.accept("t2", 1020.0)
    with pytest.raises(OverloadedError):
        ledger.accept("t3", 1020.0)  # full of live hand-offs: refuse, never forget one early
    clock.now = 1015.0  # t1's deadline passed: a replay of it is refused as late anyway
    ledger.accept("t3", 1030.0)
    assert len(ledger) == 2


async def test_a_handoff_from_another_caller_is_refused_before_any_work():
    import pytest

    from pdserve.security.secret import ClusterSecret, Mac
    from pdserve.security.handoffs import HandoffCallerError
    from pdserve.worker.transfer import sign_handoff

    mac = Mac(ClusterSecret(b"s" * 32).key("handoff"))
    runner = PrefillRunner(NeverRunLoop(), DownSends(), WorkerMetrics("prefill"), block_size=16, max_queue=4,
                           handoff_mac=mac)
    h = handoff()
    h.decode_worker_id = "decode-0"
    request = prefill_pb2.PrefillRequest(request_id="r1", prompt_token_ids=list(range(20)), handoff=h)
    sign_handoff(request, mac)
    with pytest.raises(HandoffCallerError, match="names decode 'decode-0'; the caller is 'prefill-1'"):
        await runner.run(request, caller="prefill-1")
    assert runner.num_inflight == 0 and len(runner.ledger) == 0  # a refused hand-off is not spent


class HoldingLoop:
    """Takes prompts and never finishes them; keeps what each was added with."""

    def __init__(self) -> None:
        self.engine = Engine()
        self.stream_layers: dict[str, bool] = {}
        self.added = asyncio.Event()

    async def add_request(self, prompt, params, *, request_id, stream_layers=True, **kwargs):
        self.stream_layers[request_id] = stream_layers
        self.added.set()
        return NeverDone()

    async def abort(self, request_id):
        return True


class Share:
    """A core share whose other members are idle or not, as the test says."""

    def __init__(self, others_idle: bool) -> None:
        self.idle = others_idle

    def others_idle(self) -> bool:
        return self.idle


class NeverDone:
    async def next(self, timeout):
        await asyncio.Event().wait()


class OpenSends:
    """The transfer layer's send side (a `SendControl`), every backend usable; no send ends here."""

    def unusable(self, params):
        return []

    def connect_ahead(self, params):
        pass

    def wait_verdict(self, request_id, timeout_s):
        return None

    def abort_send(self, request_id):
        return False


@pytest.mark.parametrize("share, streams", [(None, True), (Share(False), True), (Share(True), False)])
async def test_a_prompt_streams_its_layers_unless_its_forward_takes_the_idle_machines_cores(share, streams):
    """With a core share whose other workers are all idle, the prompt's forward runs on their
    cores too: its KV goes whole after the forward, not layer by layer beside it."""
    loop = HoldingLoop()
    runner = PrefillRunner(loop, OpenSends(), WorkerMetrics("prefill"), block_size=16, max_queue=4,
                           core_share=share)
    request = prefill_pb2.PrefillRequest(request_id="r1", prompt_token_ids=list(range(20)), handoff=handoff())
    running = asyncio.ensure_future(runner.run(request))
    await asyncio.wait_for(loop.added.wait(), 10)
    assert loop.stream_layers == {"r1": streams}
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running
    assert runner.num_inflight == 0

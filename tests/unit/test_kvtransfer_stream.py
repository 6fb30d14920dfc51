"""LayerStream in isolation: what it sends per step, coalescing when the sender lags, the
fallback built from its parts, cancel. The chain is a recording fake here (the real
transports are driven through engines in test_kvtransfer_engine.py)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.engine.connector import LayerSaveContext
from pdserve.kvtransfer.codec import new_transfer_id
from pdserve.kvtransfer.params import TransferParams
from pdserve.kvtransfer.sink import CacheSink, limits_for
from pdserve.kvtransfer.stream import LayerStream
from kvcaches import block_digests, make_caches, tiny_layout
from pdserve.kvtransfer.verdict import Landing, TransferVerdict
from pdserve.kvtransfer.wire import parse_header

LAYOUT = tiny_layout(num_blocks=16, num_layers=4, block_size=4)
BS = LAYOUT.block_size


class RecordingChain:
    """Lands every message in a real sink; the first send waits for `release`."""

    def __init__(self, sink: CacheSink, fail_from: int | None = None) -> None:
        self.sink = sink
        self.release = threading.Event()
        self.changed = threading.Condition()  # notified with each message and verdict
        self.layers: list[tuple[int, int, int]] = []  # (first dst block, first layer, layers)
        self.fail_from = fail_from
        self.whole: list = []

    def send_part(self, name, endpoint, message, deadline) -> None:
        if not self.layers:
            assert self.release.wait(10)
        header = parse_header(message.header, self.sink.limits)
        failing = self.fail_from is not None and len(self.layers) >= self.fail_from
        if not failing:
            self.sink.check(header, message.index)
            self.sink.commit(header, message.index, message.payload)
        with self.changed:
            self.layers.append((-1 if failing else message.index[0], header.first_layer, len(header.layers)))
            self.changed.notify_all()
        if failing:
            raise ConnectionError("peer gone")

    def send(self, job, broken=None):
        self.whole.append((job, broken))
        header = parse_header(job.message.header, self.sink.limits)
        self.sink.check(header, job.message.index)
        self.sink.commit(header, job.message.index, job.message.payload)
        return TransferVerdict(job.transfer_id.hex(), Landing.LANDED, "disk", job.num_blocks,
                               fallbacks=(broken,))


@pytest.fixture
def pool():
    with ThreadPoolExecutor(2) as executor:
        yield executor


def stream_of(chain, source, dst, num_tokens, pool, verdicts):
    params = TransferParams(new_transfer_id(), dst, 0, time.time() + 30, limits_for(LAYOUT).compat_hash,
                            (("ucx", "127.0.0.1:1"),), ("ucx", "disk"))
    chain.sink.expect(params.transfer_id, dst, time.monotonic() + 30, tag="r")

    def on_verdict(rid, verdict):
        with chain.changed:
            verdicts.append(verdict)
            chain.changed.notify_all()

    return LayerStream("r", params, list(range(len(dst))), num_tokens, "ucx", chain, limits_for(LAYOUT),
                       source, submit=pool.submit, on_verdict=on_verdict), params


def run_step(stream, source, src_blocks, done_tokens):
    stream.plan_step(LayerSaveContext({"r": tuple(src_blocks)}, {"r": done_tokens}))
    for layer, cache in enumerate(source):
        stream.add_layer(layer, cache)


def wait_for(chain, predicate, timeout_s=10.0):
    with chain.changed:
        assert chain.changed.wait_for(predicate, timeout_s)


def test_steps_before_the_last_go_whole_and_a_lagging_sender_coalesces_the_last_steps_layers(pool):
    source = make_caches(LAYOUT, seed=2)
    chain = RecordingChain(CacheSink(make_caches(LAYOUT), LAYOUT))
    verdicts: list = []
    stream, params = stream_of(chain, source, [9, 10, 11], 10, pool, verdicts)
    run_step(stream, source, [1, 2, 3], 6)  # block 0 complete: one message, every layer
    run_step(stream, source, [1, 2, 3], 10)  # the last step: blocks 1, 2 a layer at a time
    stream.finish(time.monotonic())
    chain.release.set()  # the first message was held: the last step's layers queued behind it
    wait_for(chain, lambda: verdicts)
    assert verdicts[0].ok and verdicts[0].num_messages == len(chain.layers)
    first_dst = [entry[0] for entry in chain.layers]
    assert chain.layers[0][1:] == (0, 4)  # step one: layers [0, 4) of block 0
    assert chain.layers[1][1:] == (0, 4) and len(chain.layers) == 2  # four queued layers, one message
    assert first_dst[0] != first_dst[1]
    assert chain.sink.is_complete(params.transfer_id)
    assert block_digests(chain.sink.kv_caches, [9, 10, 11]) == block_digests(source, [1, 2, 3])


def test_a_broken_stream_sends_the_whole_prompt_from_its_parts(pool):
    source = make_caches(LAYOUT, seed=3)
    chain = RecordingChain(CacheSink(make_caches(LAYOUT), LAYOUT), fail_from=1)
    chain.release.set()
    verdicts: list = []
    stream, params = stream_of(chain, source, [4, 5, 6], 12, pool, verdicts)
    run_step(stream, source, [7, 8, 9], 4)
    wait_for(chain, lambda: len(chain.layers) == 1)
    run_step(stream, source, [7, 8, 9], 8)  # its message fails: the stream breaks
    run_step(stream, source, [7, 8, 9], 12)  # the last step: kept, not sent
    stream.finish(time.monotonic())
    wait_for(chain, lambda: verdicts)
    assert len(chain.layers) == 2 and chain.layers[1][0] == -1
    (job, broken), = chain.whole
    assert broken.backend == "ucx" and "peer gone" in broken.reason
    assert verdicts[0].ok and verdicts[0].backend == "disk" and verdicts[0].tail_s > 0
    assert block_digests(chain.sink.kv_caches, [4, 5, 6]) == block_digests(source, [7, 8, 9])


def test_cancel_ends_the_stream_without_a_verdict(pool):
    source = make_caches(LAYOUT, seed=4)
    chain = RecordingChain(CacheSink(make_caches(LAYOUT), LAYOUT))
    verdicts: list = []
    stream, _ = stream_of(chain, source, [1, 2], 8, pool, verdicts)
    run_step(stream, source, [3, 4], 4)
    assert stream.cancel() and not stream.cancel()
    run_step(stream, source, [3, 4], 8)  # nothing more is queued
    stream.finish(time.monotonic())
    chain.release.set()
    pool.shutdown(wait=True)  # every send the stream started has ended
    assert verdicts == [] and len(chain.layers) <= 1

"""The fallback chain end to end: ucx and nccl fail, then redis is stopped, then the disk
directory becomes unwritable — and each transfer's verdict says where it went and why.

Sender: the chain of the default order (`ucx -> nccl -> redis -> disk -> recompute`) over a
real Redis server and a real directory. Receiver: a decode-side connector worker whose cache
receives the blocks (`prepare_receive` / `complete_receive`). The point-to-point endpoints
in the hand-off are unreachable (a closed loopback port), so ucx and nccl fail whether or not
their modules are built yet; each verdict lists them with the reason.
"""
from __future__ import annotations

import shutil
import socket
import time
from dataclasses import replace

import pytest

from pdserve.kvtransfer.chain import FallbackChain, SendJob
from pdserve.kvtransfer.codec import encode_message, ephemeral_key
from pdserve.kvtransfer.config import DEFAULT_CHAIN, KVTransferConfig
from pdserve.kvtransfer.connector import build_connector
from pdserve.kvtransfer.blocks import gather_to_host
from pdserve.kvtransfer.backend_loader import open_backends
from pdserve.kvtransfer.sink import limits_for
from kvcaches import block_digests, make_caches, tiny_layout
from pdserve.kvtransfer.verdict import RECOMPUTE, Landing, Outcome, decide

LAYOUT = tiny_layout(num_blocks=32, num_layers=2, block_size=16, num_kv_heads=2, head_dim=32)
COOLDOWN_S = 1.5  # long enough that round 3 sees redis still cooling down


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens here once the socket is closed


@pytest.fixture
def setup(redis_server, tmp_path):
    disk_dir = tmp_path / "kv-store"
    config = KVTransferConfig(backends=DEFAULT_CHAIN, redis_url=redis_server.url,
                              disk_store=str(disk_dir), step_timeout_s=3.0, failure_threshold=1,
                              probe_cooldown_s=COOLDOWN_S, redis_timeout_s=1.0)
    sender = open_backends(replace(config, transfer_port=0))
    chain = FallbackChain(config.backends, transports=sender.transports, stores=sender.stores,
                          unavailable=sender.unavailable, step_timeout_s=config.step_timeout_s,
                          health_policy=config.health_policy)
    receiver = build_connector(config, LAYOUT, listen=False)
    receiver.worker.register_kv_caches(make_caches(LAYOUT), LAYOUT)
    yield chain, receiver.receives, disk_dir, redis_server
    chain.close()
    receiver.worker.close()


SOURCE = make_caches(LAYOUT, seed=11)
PROMPT_TOKENS = 3 * 16 + 5  # 3 full blocks + a partial one (short-lived store key)


def transfer(chain, worker, request_id: str, round_: int):
    src = [1 + 4 * round_ + i for i in range(4)]  # prompt blocks on the sender
    dst = [16 + 4 * round_ + i for i in range(4)]  # blocks the receiver allocated
    params = worker.prepare_receive(request_id, dst, PROMPT_TOKENS, num_leading_blocks=0,
                                    deadline=time.time() + 20)
    port = closed_port()
    params = replace(params, endpoints=(("ucx", f"127.0.0.1:{port}"), ("nccl", f"127.0.0.1:{port}")))
    block_hashes = [1000 * (round_ + 1) + i for i in range(3)]  # the 3 full blocks
    keys = tuple(block_hashes) + (ephemeral_key(params.transfer_id, 3),)
    message = encode_message(limits_for(LAYOUT), params.transfer_id, params.dst_block_ids, keys,
                             gather_to_host(SOURCE, src))
    verdict = chain.send(SendJob(params.transfer_id, message, keys, params.endpoint_map,
                                 params.backends, params.monotonic_deadline()))
    final = worker.complete_receive(request_id, verdict)
    landed = block_digests(worker.sink.kv_caches, dst) == block_digests(SOURCE, src)
    return verdict, final, landed


def reasons(verdict) -> dict[str, str]:
    return {f.backend: f.reason for f in verdict.fallbacks}


def test_redis_then_disk_then_recompute(setup):
    chain, worker, disk_dir, redis = setup

    verdict, final, landed = transfer(chain, worker, "r1", 0)
    assert verdict.landing == Landing.LANDED and verdict.backend == "redis", verdict.describe()
    assert final.ok and landed
    assert set(reasons(verdict)) == {"ucx", "nccl"}
    assert verdict.num_blocks == 4 and verdict.num_bytes > 4 * LAYOUT.block_numel_per_layer

    redis.stop()
    verdict, final, landed = transfer(chain, worker, "r2", 1)
    assert verdict.backend == "disk" and final.ok and landed, verdict.describe()
    assert list(reasons(verdict)) == ["ucx", "nccl", "redis"]
    assert "stored 0 of 4" in reasons(verdict)["redis"]

    shutil.rmtree(disk_dir)
    disk_dir.write_text("not a directory any more")  # unwritable, even for root
    verdict, final, landed = transfer(chain, worker, "r3", 2)
    assert verdict.landing == Landing.MISSING and verdict.backend == "", verdict.describe()
    assert final.landing == Landing.MISSING and not landed
    decided = decide(final, RECOMPUTE)
    assert decided.outcome == Outcome.RECOMPUTED and decided.backend == RECOMPUTE
    assert decided.reason.startswith("transfer_failed: ")
    assert list(reasons(verdict)) == ["ucx", "nccl", "redis", "disk"]
    assert "unhealthy" in reasons(verdict)["redis"]  # failed once: skipped until a probe
    assert verdict.num_blocks == 0 and "missing" in verdict.describe()

    # Redis comes back: after the cool-down a probe succeeds and it carries transfers again.
    redis.start()
    deadline = time.monotonic() + COOLDOWN_S + 10
    while not chain.health["redis"].can_try():  # the cool-down ends: the next send probes it
        assert time.monotonic() < deadline
        time.sleep(0.05)
    verdict, final, landed = transfer(chain, worker, "r4", 3)
    assert verdict.backend == "redis" and final.ok and landed, verdict.describe()

    assert worker.sink.pending_transfer_ids == set() and worker.sink.reserved_block_ids == set()


def test_receiver_falls_back_to_recompute_when_the_store_lost_the_blocks(setup):
    chain, worker, _, redis = setup
    params = worker.prepare_receive("r9", [20, 21], 20, 0, time.time() + 20)
    keys = (7, ephemeral_key(params.transfer_id, 1))
    message = encode_message(limits_for(LAYOUT), params.transfer_id, params.dst_block_ids, keys,
                             gather_to_host(SOURCE, [1, 2]))
    verdict = chain.send(SendJob(params.transfer_id, message, keys, {}, ("redis",),
                                 params.monotonic_deadline()))
    assert verdict.backend == "redis"
    redis.flush()  # evicted before the receiver fetched
    final = worker.complete_receive("r9", verdict)
    assert final.landing == Landing.MISSING and decide(final, RECOMPUTE).outcome == Outcome.RECOMPUTED
    assert final.fallbacks[-1].backend == "redis" and "missing 2 of 2" in final.fallbacks[-1].reason
    assert worker.sink.pending_transfer_ids == set()

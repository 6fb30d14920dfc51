"""What the tiers say: the worker flag, each tier's series in a worker's /metrics, and the
router's count of cached prompt tokens by tier."""
from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.connector import KVCacheLayout
from pdserve.kvtransfer.tiers import Tiers
from pdserve.proto.pdserve.v1 import common_pb2, decode_pb2
from pdserve.router.metrics import RouterMetrics
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.settings import SettingsError, WorkerSettings
from support import wait_until

LAYOUT = KVCacheLayout("m", num_layers=2, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=8, dtype="float32")
BLOCK_BYTES = 2 * 2 * 4 * 1 * 8 * 4


def test_the_flag_sizes_the_host_tier_on_every_worker_role():
    for role in ("prefill", "decode"):
        settings = WorkerSettings.from_settings(role, {"kv_offload_host_gb": "0.5"})
        assert settings.transfer_config().host_offload_bytes == 2**29
    assert WorkerSettings.from_settings("decode", {}).transfer_config().host_offload_bytes == 0
    with pytest.raises(SettingsError, match="kv-offload-host-gb"):
        WorkerSettings.from_settings("decode", {"kv_offload_host_gb": -1})


class _Kv:
    def __init__(self) -> None:
        self.pool = BlockPool(8)
        self.offload_fence = lambda: None


def test_every_tier_says_what_it_holds_in_metrics():
    tiers = Tiers(LAYOUT, 3 * BLOCK_BYTES, None)
    events = []
    tiers.set_on_event(lambda tier, kind, hashes: events.append((tier, kind, hashes)))
    kv = _Kv()
    tiers.register_block_pool(kv)
    tiers.attach([torch.zeros(8, 2, 4, 1, 8) for _ in range(2)])
    (block,) = kv.pool.try_allocate(1)
    kv.pool.cache_full_block(block, 77, b"d")
    kv.pool.free([block])
    kv.pool.try_allocate(7)  # every free block: the cached one is evicted, offloaded
    kv.offload_fence()
    wait_until(lambda: tiers.host.holds(77), "the evicted block in the host tier")
    assert ("device", "stored", [77]) in events and ("device", "removed", [77]) in events
    assert ("host", "stored", [77]) in events
    metrics = WorkerMetrics("decode")
    metrics.watch_tiers(tiers)
    text = generate_latest(metrics.registry).decode()
    assert 'pdserve_kv_tier_blocks{tier="host"} 1.0' in text
    assert f'pdserve_kv_tier_bytes{{tier="host"}} {float(BLOCK_BYTES)}' in text
    assert f'pdserve_kv_tier_capacity_bytes{{tier="host"}} {float(3 * BLOCK_BYTES)}' in text
    assert 'pdserve_kv_tier_evictions_total{tier="device"} 1.0' in text
    for series in ("hits", "misses", "corrupt", "dropped", "onboard_seconds", "onboards"):
        assert f'pdserve_kv_tier_{series}_total{{tier="host"}}' in text
    tiers.close(5)
    assert 'pdserve_kv_tier_bytes{tier="host"} 0.0' in generate_latest(metrics.registry).decode()


def test_the_router_counts_cached_prompt_tokens_by_tier():
    metrics = RouterMetrics()
    last = decode_pb2.DecodeResponse(usage=common_pb2.Usage(
        prompt_tokens=100, cached_prompt_tokens=80, cached_tokens_by_tier={"device": 48, "host": 32}))
    metrics.observe_finished(last)
    metrics.observe_finished(last)
    values = {s.labels["tier"]: s.value for m in metrics.cached_tokens_by_tier.collect() for s in m.samples
              if s.name.endswith("_total")}
    assert values == {"device": 96.0, "host": 64.0}

"""KV events from a real engine (tiny random-weight Llama, CPU) with a host tier under its
pool: what the worker's event log mirrors, and what a router's index rebuilds from its
batches (some lost on the way, then a snapshot), equals what the pool and the host tier
really hold, as blocks are cached, evicted, offloaded and onboarded."""
from __future__ import annotations

import random

import torch

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer import KVTransferConfig, connector_factory
from pdserve.kvtransfer.verdict import RECOMPUTE
from pdserve.router.kv_index import KVIndex
from pdserve.worker.kv_events import KVEventLog, attach_kv_events

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompt(seed: int, n: int = 50) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_index_follows_the_pool_and_the_host_tier(tiny_model_factory):
    config = KVTransferConfig(backends=(RECOMPUTE,), host_offload_bytes=8 << 20)
    llm = LLM(str(tiny_model_factory("llama")), num_blocks=10, block_size=16,
              connector=connector_factory(config, listen=False))
    events = attach_kv_events(llm.engine, KVEventLog(max_pending_events=16, batch_events=8))
    index, rng = KVIndex(), random.Random(5)
    index.begin_sync()
    assert index.finish_sync(events.snapshot())
    seen: set[int] = set()
    for seed in (1, 2, 3, 1, 4, 5, 2, 6, 1):  # evicts to the host tier, comes back from it
        llm.generate([prompt(seed)], GREEDY)
        llm.engine.connector.worker.flush(30)
        batch = events.take_batch()
        seen.update(h for e in batch.events for h in e.block_hashes)
        if rng.random() < 0.3:
            continue  # lost on the way to the router
        if not index.apply(batch):
            index.begin_sync()
            assert index.finish_sync(events.snapshot())
    if not index.apply(events.take_batch()):
        index.begin_sync()
        assert index.finish_sync(events.snapshot())
    host = llm.engine.connector.tiers.host
    device = set(llm.engine.kv.pool.cached_hashes())
    assert events.holds("device") == device == index.tiers.get("device", set())
    on_host = {h for h in seen | device if host.holds(h)}
    assert on_host and events.holds("host") == on_host == index.tiers.get("host", set())
    assert events.num_dropped > 0 or index.num_gaps > 0
    llm.engine.assert_no_leaks()
    llm.engine.connector.worker.close()

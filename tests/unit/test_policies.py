"""The scheduler's policy objects: one per configured name, and the capacity check they share
asks the cache manager for the blocks a prefix hit takes out of the free list."""
from __future__ import annotations

import torch

from pdserve.engine.config import CacheConfig, CapacityPolicy, ChunkingPolicy, ModelConfig, SchedulerConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.policies import CAPACITY, CHUNKING, UNCAPPED
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.common.block_hash import hash_prompt_blocks

BS = 8
MODEL = ModelConfig(architecture="llama", vocab_size=100, hidden_size=16, intermediate_size=32,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                    max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0)


def test_every_policy_name_has_its_object():
    assert set(CAPACITY) == set(CapacityPolicy)
    assert set(CHUNKING) == set(ChunkingPolicy)


def test_a_request_reaches_its_prompt_plus_max_tokens():
    r = Request("a", list(range(10)), SamplingParams(max_tokens=6))
    assert r.final_length == 16
    r.output_token_ids += [1, 2]
    assert r.final_length == 16  # output tokens are part of it, not added to it


def test_free_blocks_after_taking_a_hit_count_its_idle_cached_blocks_out():
    kv = KVCacheManager(MODEL, CacheConfig(block_size=BS, num_blocks=8), torch.device("cpu"))
    prompt = list(range(3 * BS + 1))
    first = Request("first", prompt, SamplingParams(max_tokens=1))
    first.block_hashes = hash_prompt_blocks(prompt, BS, salt=1)
    assert kv.prepare_resources(first, len(prompt))
    first.num_computed_tokens = len(prompt)
    kv.update_resources(first)
    kv.free_resources("first")  # three cached blocks, idle in the free list
    second = Request("second", prompt, SamplingParams(max_tokens=1))
    second.block_hashes = first.block_hashes
    hit = kv.find_prefix_hit(second)
    assert hit.num_blocks == 3
    assert kv.num_free_blocks_after_taking(hit) == kv.get_num_free_blocks() - 3
    kv.take_prefix_hit(second, hit)
    assert kv.get_num_free_blocks() == 8 - 3
    kv.free_resources("second")
    kv.assert_all_free()


def test_equal_progress_shares_the_budget_and_chunked_prefill_off_uncaps_it():
    equal = CHUNKING[ChunkingPolicy.EQUAL_PROGRESS](SchedulerConfig(), BS)
    assert equal.chunk_cap(4, 256) == 64
    assert equal.chunk_cap(64, 256) == BS  # at least a block each
    assert equal.chunk_cap(1, 256) == 256
    whole = CHUNKING[ChunkingPolicy.EQUAL_PROGRESS](SchedulerConfig(enable_chunked_prefill=False), BS)
    assert whole.chunk_cap(4, 256) == UNCAPPED


def test_a_request_the_pool_cannot_hold_takes_neither_its_hit_nor_fresh_blocks():
    kv = KVCacheManager(MODEL, CacheConfig(block_size=BS, num_blocks=4), torch.device("cpu"))
    prompt = list(range(2 * BS + 1))
    first = Request("first", prompt, SamplingParams(max_tokens=1))
    first.block_hashes = hash_prompt_blocks(prompt, BS, salt=1)
    assert kv.try_take_prefix_hit(first, kv.find_prefix_hit(first), len(prompt))
    first.num_computed_tokens = len(prompt)
    kv.update_resources(first)
    kv.free_resources("first")
    second = Request("second", prompt, SamplingParams(max_tokens=1))
    second.block_hashes = first.block_hashes
    hit = kv.find_prefix_hit(second)
    assert hit.num_blocks == 2
    assert not kv.try_take_prefix_hit(second, hit, 3 * BS)  # 2 + 3 blocks > 4
    assert kv.blocks_of("second") == [] and kv.get_num_free_blocks() == 4
    assert kv.pool.get_cached_block(first.block_hashes[0]) is hit.blocks[0]  # the hit stays cached
    assert kv.try_take_prefix_hit(second, hit, 1)
    assert kv.blocks_of("second")[:2] == [b.block_id for b in hit.blocks]
    kv.free_resources("second")
    kv.assert_all_free()

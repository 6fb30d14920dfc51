"""KV cache manager: the resource-manager contract, prefix hits, windows, sizing."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.block_pool import NULL_BLOCK_ID
from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.common.errors import InvalidRequestError
from pdserve.engine.kv_cache_manager import KVCacheManager, size_num_blocks
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.common.block_hash import hash_prompt_blocks

BS = 8
MODEL = ModelConfig(architecture="llama", vocab_size=100, hidden_size=16, intermediate_size=32,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
                    max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)
CPU = torch.device("cpu")


def manager(num_blocks: int = 8, **cache) -> KVCacheManager:
    return KVCacheManager(MODEL, CacheConfig(block_size=BS, num_blocks=num_blocks, **cache), CPU)


def request(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    r = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens))
    r.block_hashes = hash_prompt_blocks(prompt, BS, salt=1)
    return r


def compute(kv: KVCacheManager, req: Request, n: int) -> None:
    """What a step does: blocks for n more tokens, then the tokens count as computed."""
    assert kv.prepare_resources(req, n)
    req.num_computed_tokens += n
    kv.update_resources(req)


def test_buffers_have_the_design_layout():
    kv = manager(num_blocks=6)
    assert kv.num_blocks == 7  # + the null block
    assert kv.get_max_resource_count() == 6
    for layer in range(MODEL.num_layers):
        assert kv.get_buffers(layer).shape == (7, 2, BS, MODEL.num_kv_heads, MODEL.head_dim)
        assert kv.get_buffers(layer).dtype == torch.float32


def test_sizing_smaller_of_max_tokens_and_memory():
    block_bytes = MODEL.num_layers * 2 * BS * MODEL.num_kv_heads * MODEL.head_dim * 4
    by_tokens = CacheConfig(block_size=BS, max_tokens=10 * BS)
    assert size_num_blocks(MODEL, by_tokens, CPU, bytes_free=1000 * block_bytes) == 10 + 1
    by_memory = CacheConfig(block_size=BS, max_tokens=1000 * BS, free_memory_fraction=0.5)
    assert size_num_blocks(MODEL, by_memory, CPU, bytes_free=40 * block_bytes) == 20 + 1
    only_memory = CacheConfig(block_size=BS, free_memory_fraction=1.0)
    assert size_num_blocks(MODEL, only_memory, CPU, bytes_free=7 * block_bytes) == 7 + 1
    with pytest.raises(ValueError, match="single KV block"):
        size_num_blocks(MODEL, only_memory, CPU, bytes_free=block_bytes - 1)


def test_cpu_sizing_takes_a_share_of_the_memory_the_os_reports_available(monkeypatch):
    from pdserve.common.util import available_memory_bytes
    from pdserve.engine import kv_cache_manager

    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    assert 0 < available_memory_bytes() <= total
    block_bytes = MODEL.num_layers * 2 * BS * MODEL.num_kv_heads * MODEL.head_dim * 4
    monkeypatch.setattr(kv_cache_manager, "available_memory_bytes", lambda: 300 * block_bytes)
    assert size_num_blocks(MODEL, CacheConfig(block_size=BS, free_memory_fraction=0.1), CPU) == 30 + 1


def test_cache_config_rejects_bad_values():
    with pytest.raises(InvalidRequestError, match="block_size"):
        CacheConfig(block_size=3)
    with pytest.raises(InvalidRequestError, match="free_memory_fraction"):
        CacheConfig(free_memory_fraction=0.0)
    with pytest.raises(InvalidRequestError, match="attention_window"):
        CacheConfig(attention_window=0)


def test_prepare_allocates_whole_blocks_and_nothing_when_short():
    kv = manager(num_blocks=4)
    a = request("a", list(range(20)))
    assert kv.prepare_resources(a, 20)  # 20 tokens -> 3 blocks
    assert len(kv.blocks_of("a")) == 3
    assert kv.get_num_free_blocks() == 1
    assert kv.prepare_resources(a, 4)  # 24 tokens still fit in 3 blocks
    assert len(kv.blocks_of("a")) == 3
    b = request("b", list(range(30, 50)))
    assert not kv.prepare_resources(b, 20)
    assert kv.blocks_of("b") == [] and kv.get_num_free_blocks() == 1
    kv.free_resources("a")
    kv.free_resources("a")  # idempotent
    kv.free_resources("b")
    kv.assert_all_free()


def test_batch_cache_indices_are_block_tables():
    kv = manager()
    a, b = request("a", [1] * 10), request("b", [2] * 6)
    kv.prepare_resources(a, 10)
    kv.prepare_resources(b, 6)
    tables = kv.get_batch_cache_indices(["a", "b", "nobody"])
    assert [len(t) for t in tables] == [2, 1, 0]
    assert set(tables[0]).isdisjoint(tables[1])
    assert NULL_BLOCK_ID not in tables[0] + tables[1]
    kv.free_resources("a")
    kv.free_resources("b")
    kv.assert_all_free()


def test_needed_to_completion_counts_blocks_not_yet_held():
    kv = manager(num_blocks=16)
    r = request("r", list(range(12)), max_tokens=14)  # 26 tokens -> 4 blocks
    assert kv.get_needed_resource_to_completion(r, max_model_len=256) == 4
    kv.prepare_resources(r, 12)
    assert kv.get_needed_resource_to_completion(r, max_model_len=256) == 2
    assert kv.get_needed_resource_to_completion(r, max_model_len=16) == 0  # capped by context
    kv.free_resources("r")
    kv.assert_all_free()


def test_full_prompt_blocks_are_published_and_found():
    kv = manager(num_blocks=16)
    prompt = list(range(1, 21))  # 2 full blocks + 4 tokens
    a = request("a", prompt)
    compute(kv, a, 20)
    kv.free_resources("a")
    kv.assert_all_free()  # cached blocks are free (evictable) blocks

    b = request("b", prompt + [50, 51, 52])
    hit = kv.find_prefix_hit(b)
    assert hit.num_blocks == 2
    kv.take_prefix_hit(b, hit)
    assert kv.blocks_of("b") == [blk.block_id for blk in hit.blocks]
    assert all(blk.ref_cnt == 1 for blk in hit.blocks)
    kv.free_resources("b")
    kv.assert_all_free()


def test_prefix_hit_leaves_the_last_prompt_token_to_compute():
    kv = manager(num_blocks=16)
    prompt = list(range(1, 17))  # exactly 2 full blocks
    a = request("a", prompt)
    compute(kv, a, 16)
    kv.free_resources("a")
    again = request("again", prompt)
    assert kv.find_prefix_hit(again).num_blocks == 1  # the second block holds the last token
    kv.assert_all_free()


def test_a_different_block_breaks_the_chain():
    kv = manager(num_blocks=16)
    a = request("a", list(range(1, 25)))
    compute(kv, a, 24)
    kv.free_resources("a")
    changed = list(range(1, 25))
    changed[10] = 99  # in the second block: only the first block matches
    assert kv.find_prefix_hit(request("b", changed + [0])).num_blocks == 1
    changed[2] = 99
    assert kv.find_prefix_hit(request("c", changed + [0])).num_blocks == 0


def test_generated_tokens_are_never_published():
    kv = manager(num_blocks=16)
    a = request("a", list(range(1, 13)))  # 1 full block + 4 tokens
    compute(kv, a, 12)
    a.output_token_ids += [7, 8, 9, 10, 11, 12]
    compute(kv, a, 6)  # block 2 is now full of prompt + generated tokens: not a prompt block
    assert len(kv.pool.cached_hashes()) == 1
    kv.free_resources("a")
    kv.assert_all_free()


def test_prefix_caching_off_finds_nothing():
    kv = manager(num_blocks=16, enable_prefix_caching=False)
    prompt = list(range(1, 21))
    compute(kv, request("a", prompt), 20)
    kv.free_resources("a")
    assert kv.find_prefix_hit(request("b", prompt + [0])).num_blocks == 0
    kv.assert_all_free()


def test_window_releases_blocks_behind_it():
    kv = manager(num_blocks=16, attention_window=12)
    r = request("r", list(range(1, 41)), max_tokens=30)
    compute(kv, r, 40)
    # the next query (position 40) sees positions 29..40: blocks 0..2 (positions 0..23) are dead
    assert kv.blocks_of("r")[:3] == [NULL_BLOCK_ID] * 3
    assert NULL_BLOCK_ID not in kv.blocks_of("r")[3:]
    assert kv.get_num_free_blocks() == 16 - 2
    assert kv.num_blocks_for_tokens(1000) == 3  # cdiv(12, 8) + 1 at most, ever
    assert kv.get_needed_resource_to_completion(r, max_model_len=256) == 1
    r.output_token_ids += [0] * 10
    compute(kv, r, 10)  # 50 tokens; next query at 50 sees 39..50: block 4 onward
    assert kv.blocks_of("r")[:4] == [NULL_BLOCK_ID] * 4
    assert len([b for b in kv.blocks_of("r") if b != NULL_BLOCK_ID]) == 3
    kv.free_resources("r")
    kv.assert_all_free()


def test_padding_request_holds_and_returns_blocks():
    kv = manager(num_blocks=4)
    assert kv.add_padding_request("pad", 17)  # 3 blocks
    assert kv.get_num_free_blocks() == 1
    with pytest.raises(ValueError):
        kv.add_padding_request("pad", 1)
    assert not kv.add_padding_request("pad2", 16)
    with pytest.raises(AssertionError):
        kv.assert_all_free()
    kv.free_resources("pad")
    kv.assert_all_free()

"""Prefix-cache poisoning by key collision (issue 25, item 2), reproduced with the key space
shrunk by the test hook `common.block_hash.KEY_BITS`: two prompts whose first blocks share a
key are found in well under a second; the block of the first is then refused to the second
by the engine's prefix cache and by the prefix store (a real directory, a real Redis server),
because each cached block and each record carries its full prefix digest. Refusals are
counted; the right prompt still hits."""
from __future__ import annotations

import os

import pytest
import torch

from pdserve.common import block_hash
from pdserve.common.block_hash import KEY_BITS, prompt_blocks
from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.engine.connector import ConnectorRequest
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.backends.disk import DiskStore
from pdserve.kvtransfer.codec import encode_message
from pdserve.kvtransfer.connector.prefix_store import StoreLoads
from pdserve.kvtransfer.sink import limits_for
from pdserve.kvtransfer.wire import payload_nbytes
from kvcaches import tiny_layout

LAYOUT = tiny_layout(num_blocks=16, block_size=8)
BS = LAYOUT.block_size
SALT = LAYOUT.compatibility_hash()
KEY = os.urandom(32)  # as block_hash_key(secret) derives one
MODEL = ModelConfig(architecture="llama", vocab_size=1000, hidden_size=16, intermediate_size=32,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                    max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)


@pytest.fixture
def short_keys(monkeypatch):
    monkeypatch.setattr(block_hash, "KEY_BITS", 12)


def colliding_prompts(tail: int = 2) -> tuple[list[int], list[int]]:
    """Two prompts of 1 block + `tail` tokens whose first blocks differ but share a key."""
    seen: dict[int, list[int]] = {}
    for i in range(200_000):
        first = [i % 1000, (i // 1000) % 1000, 7, 9, 1, 2, 3, 4]
        key = prompt_blocks(first, BS, SALT, KEY).hashes[0]
        if key in seen:
            return seen[key] + [1] * tail, first + [1] * tail
        seen[key] = first
    raise AssertionError("no collision found")


def request(rid: str, prompt: list[int]) -> Request:
    r = Request(rid, list(prompt), SamplingParams(max_tokens=2))
    blocks = prompt_blocks(prompt, BS, SALT, KEY)
    r.block_hashes, r.block_digests = blocks.hashes, blocks.digests
    return r


def test_keys_are_full_width_and_keyed_without_the_hook():
    assert KEY_BITS == 63
    prompt = list(range(32))
    ours = prompt_blocks(prompt, BS, SALT, KEY)
    assert all(0 <= h < 2**63 for h in ours.hashes) and len(set(ours.hashes)) == 4
    assert prompt_blocks(prompt, BS, SALT, os.urandom(32)).hashes != ours.hashes  # no key, no keys
    assert prompt_blocks(prompt, BS, SALT, KEY, cache_salt="tenant-a").hashes[0] != ours.hashes[0]
    assert prompt_blocks(prompt, BS, SALT, KEY, cache_salt="tenant-a").hashes == \
        prompt_blocks(prompt, BS, SALT, KEY, cache_salt="tenant-a").hashes


def test_engine_prefix_cache_refuses_a_colliding_block(short_keys):
    victim, attacker = colliding_prompts()
    assert request("a", attacker).block_hashes[0] == request("v", victim).block_hashes[0]
    kv = KVCacheManager(MODEL, CacheConfig(block_size=BS, num_blocks=8), torch.device("cpu"))
    planted = request("attacker", attacker)
    assert kv.prepare_resources(planted, len(attacker))
    planted.num_computed_tokens = len(attacker)
    kv.update_resources(planted)  # its first block is published under the shared key
    kv.free_resources("attacker")
    assert kv.find_prefix_hit(request("victim", victim)).num_blocks == 0  # refused: another prefix
    assert kv.num_digest_mismatches == 1
    assert kv.find_prefix_hit(request("again", attacker)).num_blocks == 1  # its own prompt still hits
    kv.assert_all_free()


@pytest.fixture(params=["disk", "redis"])
def store(request, tmp_path):
    if request.param == "disk":
        yield DiskStore(tmp_path / "kv", mac_key=os.urandom(32))
        return
    from pdserve.kvtransfer.backends.redis import RedisStore

    made = RedisStore(request.getfixturevalue("redis_server").url, mac_key=os.urandom(32))
    yield made
    made.close()


def test_prefix_store_refuses_a_colliding_record(short_keys, store):
    victim, attacker = colliding_prompts()
    limits = limits_for(LAYOUT)
    nbytes = payload_nbytes(1, LAYOUT.num_layers, BS, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.dtype)
    planted = request("attacker", attacker)
    message = encode_message(limits, os.urandom(16), [0], planted.block_hashes, b"\x66" * nbytes)
    assert store.put(planted.block_hashes, message, planted.block_digests) == 1
    loads = StoreLoads(store, LAYOUT)

    def view(r: Request) -> ConnectorRequest:
        return ConnectorRequest(r.request_id, tuple(r.prompt_token_ids), tuple(r.block_hashes), None,
                                tuple(r.block_digests))

    assert loads.match(view(request("victim", victim)), 0) == 0  # the key is there, the digest is not its
    assert store.num_digest_mismatches == 1
    assert loads.match(view(request("again", attacker)), 0) == 1  # the record's own prefix loads it
    assert bytes(loads.load_spec("again", [3], BS).payloads[0]) == b"\x66" * nbytes


def test_the_engine_computes_a_colliding_prompt_instead_of_reusing_the_planted_block(
        short_keys, tiny_model_factory, one_torch_thread):
    """The whole engine (a tiny random-weight Llama): the attacker's prompt runs first and its
    first block is cached under the key the victim's first block also has; the victim's
    prompt is then computed, not served the attacker's KV, and its tokens equal those of a
    fresh engine."""
    from pdserve.engine.llm import LLM

    model = str(tiny_model_factory("llama"))
    llm = LLM(model, num_blocks=32, block_size=16)
    engine = llm.engine
    seen: dict[int, list[int]] = {}
    for i in range(100_000):
        first = [i % 256, (i // 256) % 256, *range(3, 17)]
        key = prompt_blocks(first, 16, engine.compat_hash, engine.config.block_hash_key).hashes[0]
        if key in seen and seen[key] != first:
            attacker, victim = seen[key] + [5, 6, 7], first + [5, 6, 7]
            break
        seen[key] = first
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (reference,) = LLM(model, num_blocks=32, block_size=16).generate([victim], greedy)
    llm.generate([attacker], greedy)
    (served,) = llm.generate([victim], greedy)
    assert served.num_cached_tokens == 0 and engine.kv.num_digest_mismatches == 1
    assert served.token_ids == reference.token_ids
    (again,) = llm.generate([attacker], greedy)
    assert again.num_cached_tokens == 16  # the block's own prompt still hits
    engine.assert_no_leaks()

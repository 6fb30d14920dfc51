"""The tiers under the pool through real engines (tiny random-weight Llama, CPU): blocks the
pool evicts are offloaded, found again in the tier that holds them and onboarded before the
forward, with greedy text equal to transformers'; a restarted engine finds a chat's history,
answers included, in the disk or Redis tier; corrupt records are misses; every block back."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import transformers

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer import KVTransferConfig, connector_factory
from pdserve.kvtransfer.verdict import RECOMPUTE
from support import wait_until

BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ANSWER = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
HOST_BYTES = 8 << 20


def prompt(seed: int, n: int = 50) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tiered(model_dir, *, host_bytes=HOST_BYTES, store=None, where=None, num_blocks=10) -> LLM:
    location = {"disk": {"disk_store": where}, "redis": {"redis_url": where}}.get(store, {})
    config = KVTransferConfig(backends=(store, RECOMPUTE) if store else (RECOMPUTE,), prefix_cache=store,
                              host_offload_bytes=host_bytes, **location)
    return LLM(str(model_dir), num_blocks=num_blocks, block_size=BLOCK,
               connector=connector_factory(config, listen=False))


def hf_greedy(model_dir, ids: list[int], n: int) -> list[int]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                      attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def tiers_of(llm) -> dict:
    return {s.tier: s for s in llm.engine.connector.tiers.stats()}


def evict_everything(llm, seeds=(101, 102, 103, 104)) -> None:
    llm.generate([prompt(s) for s in seeds], GREEDY)  # one at a time would leave some cached
    for s in seeds:
        llm.generate(prompt(s + 50), GREEDY)
    llm.engine.connector.worker.flush(30)


def test_evicted_blocks_come_back_from_the_host_tier(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    llm = tiered(model_dir)
    first = prompt(1)
    (before,) = llm.generate([first], GREEDY)
    evict_everything(llm)
    assert tiers_of(llm)["host"].blocks > 0 and tiers_of(llm)["device"].evictions > 0
    (again,) = llm.generate([first], GREEDY)
    assert again.token_ids == before.token_ids == tuple(hf_greedy(model_dir, first, 8))
    host = tiers_of(llm)["host"]
    assert host.hits >= 1 and host.onboards >= 1 and host.onboard_seconds > 0
    assert again.num_cached_tokens + again.num_external_tokens == 48  # 3 full blocks, the last token computed
    llm.engine.assert_no_leaks()
    tiers = llm.engine.connector.tiers
    llm.engine.connector.worker.close()
    assert tiers.host._buffer is None and tiers.host.stats.bytes == 0  # the host memory is given back


def test_usage_names_the_tier_each_cached_token_came_from(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    llm = tiered(model_dir)
    first = prompt(2)
    llm.generate([first], GREEDY)
    evict_everything(llm)
    outs = list(llm.generate_stream(first, GREEDY))
    by_tier = dict(outs[-1].cached_tokens_by_tier)
    assert by_tier.get("host", 0) > 0 and sum(by_tier.values()) == 48
    assert by_tier.get("device", 0) == outs[-1].num_cached_tokens
    llm.engine.assert_no_leaks()
    llm.engine.connector.worker.close()


def block_bytes(model_dir) -> int:
    import json

    c = json.loads((Path(model_dir) / "config.json").read_text())
    heads = c.get("num_key_value_heads", c["num_attention_heads"])
    return c["num_hidden_layers"] * 2 * BLOCK * heads * (c["hidden_size"] // c["num_attention_heads"]) * 4


def _history_from_a_lower_tier(model_dir, store: str, where: str, host_blocks: int) -> None:
    """A chat's first turn on one engine (whose host tier holds `host_blocks` blocks, or is
    off: what it evicts goes to the store); its second turn on a fresh engine finds the
    prompt and the answer there."""
    first = prompt(3, 40)
    llm = tiered(model_dir, host_bytes=host_blocks * block_bytes(model_dir), store=store, where=where)
    (turn1,) = llm.generate([first], ANSWER)
    evict_everything(llm)
    written = tiers_of(llm)[store].blocks
    llm.engine.connector.worker.close()
    assert written > 0
    second = first + list(turn1.token_ids) + prompt(4, 9)
    fresh = tiered(model_dir, host_bytes=0, store=store, where=where)
    outs = list(fresh.generate_stream(second, GREEDY))
    last = outs[-1]
    by_tier = dict(last.cached_tokens_by_tier)
    history = len(first) + len(turn1.token_ids)
    assert by_tier.get(store, 0) >= history - BLOCK  # the answer's full blocks too, not the prompt's alone
    tokens = tuple(t for o in outs for t in o.new_token_ids)
    assert tokens == tuple(hf_greedy(model_dir, second, 8))
    assert tiers_of(fresh)[store].hits >= history // BLOCK - 1
    fresh.engine.assert_no_leaks()
    fresh.engine.connector.worker.close()


def test_history_comes_back_from_the_disk_tier(tiny_model_factory, tmp_path):
    _history_from_a_lower_tier(tiny_model_factory("llama"), "disk", str(tmp_path / "store"), host_blocks=2)


def test_history_comes_back_from_the_redis_tier(tiny_model_factory, redis_server):
    _history_from_a_lower_tier(tiny_model_factory("llama"), "redis", redis_server.url, host_blocks=0)


def test_a_corrupt_or_truncated_record_is_a_counted_miss(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("llama")
    where = str(tmp_path / "store")
    first = prompt(5)
    llm = tiered(model_dir, host_bytes=0, store="disk", where=where)
    llm.generate([first], GREEDY)
    llm.engine.connector.worker.flush(30)
    llm.engine.connector.worker.close()
    records = [p for p in Path(where).rglob("*") if p.is_file()]
    assert records
    for i, path in enumerate(records):
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2] if i % 2 else data[:-64] + bytes(64))
    fresh = tiered(model_dir, host_bytes=0, store="disk", where=where)
    outs = list(fresh.generate_stream(first, GREEDY))
    assert dict(outs[-1].cached_tokens_by_tier).get("disk", 0) == 0
    assert tuple(t for o in outs for t in o.new_token_ids) == tuple(hf_greedy(model_dir, first, 8))
    assert tiers_of(fresh)["disk"].corrupt >= 1
    fresh.engine.assert_no_leaks()
    fresh.engine.connector.worker.close()


def test_redis_going_away_turns_its_tier_off_and_back_on(tiny_model_factory, redis_server):
    model_dir = tiny_model_factory("llama")
    config = KVTransferConfig(backends=("redis", RECOMPUTE), prefix_cache="redis", redis_url=redis_server.url,
                              host_offload_bytes=0, probe_cooldown_s=0.2, failure_threshold=1)
    llm = LLM(str(model_dir), num_blocks=10, block_size=BLOCK, connector=connector_factory(config, listen=False))
    try:
        redis_server.stop()
        llm.generate([prompt(6)], GREEDY)  # the write-through fails: the tier goes off
        llm.engine.connector.worker.flush(30)
        wait_until(lambda: not tiers_of(llm)["redis"].enabled, "the redis tier off")
        assert tiers_of(llm)["redis"].reason
        redis_server.start()
        wait_until(lambda: tiers_of(llm)["redis"].enabled, "the redis tier back on", timeout=20)
        llm.engine.assert_no_leaks()
    finally:
        llm.engine.connector.worker.close()


def test_a_prefill_finds_the_answer_a_decode_generated(tiny_model_factory, tmp_path):
    """Disaggregated: the decode writes the blocks it generates through to the shared store,
    so the next turn's prefill (another worker) loads the whole history, answer included."""
    from engine_pair import BLOCK as PAIR_BLOCK, assert_all_blocks_back, disaggregated, engines

    model_dir = tiny_model_factory("llama")
    config = KVTransferConfig(backends=("disk", RECOMPUTE), disk_store=str(tmp_path / "store"), prefix_cache="disk",
                              host_offload_bytes=HOST_BYTES)
    first = prompt(7, 44)  # with its 6-token answer, the third block fills: 12 prompt, 4 answer tokens
    with engines(model_dir, config) as (prefill, decode, local):
        tokens, sent, received = disaggregated(prefill, decode, first, "turn-1")
        assert received.ok
        decode.engine.connector.worker.flush(30)
        # the answer's block is in the store (written through on the offload thread)
        wait_until(lambda: tiers_of(decode)["disk"].blocks >= 1, "the decode's answer block stored")
        history = first + tokens[:-1]  # the last token's KV is the next prompt's to compute
        second = history + tokens[-1:] + prompt(8, 9)
        out = list(prefill.generate_stream(second, GREEDY))  # the prefill engine, locally: its lookups
        by_tier = dict(out[-1].cached_tokens_by_tier)
        assert by_tier.get("disk", 0) + by_tier.get("device", 0) >= len(history) // PAIR_BLOCK * PAIR_BLOCK
        assert by_tier.get("disk", 0) >= PAIR_BLOCK  # the answer's blocks came from the decode, through the store
        assert tuple(t for o in out for t in o.new_token_ids) == local.generate(second, GREEDY)[0].token_ids
        assert_all_blocks_back(prefill, decode)

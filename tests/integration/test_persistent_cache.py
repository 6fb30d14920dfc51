"""The disk store as a persistent prefix cache across engine restarts.

Engine instance 1 generates for some prompts; its full prompt blocks go to a directory.
A fresh instance 2 (new process state, new cache, same directory) finds them, logs how many
blocks matched, loads them, computes only the rest, and returns the same greedy tokens.
"""
from __future__ import annotations

import logging

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

from pdserve.kvtransfer import KVTransferConfig, connector_factory
from pdserve.kvtransfer.verdict import RECOMPUTE

BLOCK = 16
PROMPT_LENS = (17, 40, 64, 70)  # across block boundaries; 64 is exactly 4 blocks
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompts(seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


def run_instance(model_dir, store_dir, store_key=None):
    config = KVTransferConfig(backends=("disk", RECOMPUTE), disk_store=str(store_dir),
                              prefix_cache="disk", store_key=store_key)
    llm = LLM(str(model_dir), connector=connector_factory(config, listen=False), num_blocks=64, block_size=BLOCK)
    connector = llm.engine.connector
    try:
        completions = llm.generate(prompts(), GREEDY)
        assert connector.worker.flush(30), "background stores did not finish"
        llm.engine.assert_no_leaks()
    finally:
        connector.worker.close()
    return completions, connector


@pytest.mark.parametrize("store_key", [None, b"k" * 32], ids=["clear", "sealed"])
def test_restarted_engine_loads_blocks_from_disk(tiny_model_factory, tmp_path, caplog, store_key):
    """Sealed (a deployment with a secret: records encrypted at rest) or not, a restart
    loads the blocks and its greedy output is unchanged."""
    model_dir = tiny_model_factory("llama")
    store = tmp_path / "kv-store"

    first, conn1 = run_instance(model_dir, store, store_key)
    assert all(c.num_external_tokens == 0 for c in first)  # the store started empty
    assert conn1.scheduler.num_matched_blocks == 0
    assert len(list(store.rglob("*.kv"))) == sum((n - 1) // BLOCK for n in PROMPT_LENS) + 1
    # (the 64-token prompt's 4th block completes in the forward that samples, so it is
    # stored too, though a restart never loads it: one prompt token is always computed)

    with caplog.at_level(logging.INFO, logger="pdserve.kvtransfer.connector"):
        second, conn2 = run_instance(model_dir, store, store_key)
    matched = [r.getMessage() for r in caplog.records if "matched" in r.getMessage()]
    assert matched and any("matched 3 of 3 blocks" in m for m in matched), matched

    for prompt, a, b in zip(prompts(), first, second):
        assert b.token_ids == a.token_ids  # identical greedy output
        loadable = (len(prompt) - 1) // BLOCK * BLOCK
        assert b.num_external_tokens == loadable
        assert b.num_computed_prompt_tokens == len(prompt) - loadable
    assert conn2.scheduler.num_matched_blocks == sum((n - 1) // BLOCK for n in PROMPT_LENS)


def test_corrupt_record_is_recomputed_not_loaded(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("llama")
    store = tmp_path / "kv-store"
    first, _ = run_instance(model_dir, store)
    records = sorted(store.rglob("*.kv"))
    for path in records:  # flip one payload byte in every record
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x5A
        path.write_bytes(bytes(data))
    second, conn = run_instance(model_dir, store)
    assert [c.token_ids for c in second] == [c.token_ids for c in first]
    assert all(c.num_external_tokens == 0 for c in second)
    assert conn.scheduler.num_matched_blocks == 0

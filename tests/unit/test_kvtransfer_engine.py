"""A disaggregated request through two real engines in one process (tiny model, CPU).

The decode engine admits a remote-prefill request and allocates its blocks; its connector
reserves them (`prepare_receive`); the prefill engine computes the prompt and its connector
sends the blocks through the chain; the decode side settles the verdict and decodes. Greedy
tokens must equal a plain local engine's, and every block must be back in both pools.
"""
from __future__ import annotations

import time

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

from pdserve.kvtransfer import KVTransferConfig, ReceiveParams, build_connector
from pdserve.kvtransfer.codec import new_transfer_id
from pdserve.kvtransfer.registry import is_importable
from pdserve.kvtransfer.verdict import RECOMPUTE, Outcome

BLOCK = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _params():
    out = ["disk"]
    for name in ("ucx", "nccl"):
        ok, why = is_importable(name)
        out.append(pytest.param(name, marks=pytest.mark.skipif(not ok, reason=f"{name}: {why}")))
    return out


def run_until(llm, done, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    outputs = []
    while not done():
        assert time.monotonic() < deadline, "engine did not finish in time"
        outputs += llm.step()
    return outputs


def disaggregated(prefill, decode, prompt, rid):
    """One request, decode-first hand-off. Returns (tokens, sender verdict, receiver verdict)."""
    d_engine, p_engine = decode.engine, prefill.engine
    tid = new_transfer_id()
    d_engine.add_request(prompt, GREEDY, request_id=rid, remote_prefill=True,
                         transfer_params=ReceiveParams(tid))
    waiting = []
    run_until(decode, lambda: waiting or waiting.extend(d_engine.step()[1]))
    request = waiting[0]
    num_leading = max(0, request.num_cached_tokens) // BLOCK
    params = d_engine.connector.receives.prepare_receive(
        rid, d_engine.remote_block_ids(rid), len(prompt), num_leading, time.time() + 30, tid)

    p_engine.add_request(prompt, FIRST_TOKEN, request_id=f"p-{rid}", transfer_params=params)
    outs = run_until(prefill, lambda: not p_engine.has_unfinished())
    first = [t for o in outs if o.request_id == f"p-{rid}" for t in o.new_token_ids]
    sent = p_engine.connector.sends.wait_verdict(f"p-{rid}", 10)
    received = d_engine.connector.receives.complete_receive(rid, sent)
    if received.ok:
        assert d_engine.finish_remote_prefill(rid, first[0])
    else:
        assert d_engine.recompute_remote_prefill(rid)
    outs = run_until(decode, lambda: not d_engine.has_unfinished())
    # (finish_remote_prefill emits the prefill's first token as the request's first delta)
    tokens = [t for o in outs if o.request_id == rid for t in o.new_token_ids]
    return tokens, sent, received


@pytest.mark.parametrize("backend", _params())
def test_disaggregated_greedy_equals_local(tiny_model_factory, tmp_path, backend):
    model_dir = tiny_model_factory("llama")
    config = KVTransferConfig(backends=(backend, RECOMPUTE), disk_store=str(tmp_path / "store"))
    prefill = LLM(str(model_dir), connector=build_connector(config, listen=False),
                  num_blocks=64, block_size=BLOCK)
    decode = LLM(str(model_dir), connector=build_connector(config), num_blocks=64,
                 block_size=BLOCK)
    local = LLM(str(model_dir), num_blocks=64, block_size=BLOCK)
    g = torch.Generator().manual_seed(4)  # a seed whose greedy continuation varies
    base = torch.randint(3, 256, (40,), generator=g).tolist()
    prompts = [base, base[:33] + [7, 8, 9, 10, 11]]  # the second shares 2 blocks with the first
    try:
        for i, prompt in enumerate(prompts):
            tokens, sent, received = disaggregated(prefill, decode, prompt, f"r{i}")
            assert sent.ok and sent.backend == backend and received.ok, received.describe()
            assert sent.tail_s >= sent.duration_s > 0  # the tail: gather + send + verdict
            expected = local.generate(prompt, GREEDY)[0].token_ids
            assert tuple(tokens) == expected
        # the second prompt's first 2 blocks were a prefix hit on the decode side: not sent
        assert sent.num_blocks == 1
        for llm in (prefill, decode):
            llm.engine.assert_no_leaks()
        assert decode.engine.connector.worker.sink.reserved_block_ids == set()
    finally:
        prefill.engine.connector.worker.close()
        decode.engine.connector.worker.close()


def test_failed_transfer_is_recomputed_by_the_decode_side(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("llama")
    broken = tmp_path / "not-a-dir"
    broken.write_text("x")  # the store cannot be written: the chain ends in recompute
    config = KVTransferConfig(backends=("disk", RECOMPUTE), disk_store=str(broken))
    prefill = LLM(str(model_dir), connector=build_connector(config, listen=False),
                  num_blocks=64, block_size=BLOCK)
    decode = LLM(str(model_dir), connector=build_connector(config), num_blocks=64, block_size=BLOCK)
    local = LLM(str(model_dir), num_blocks=64, block_size=BLOCK)
    prompt = list(range(3, 40))
    try:
        tokens, sent, received = disaggregated(prefill, decode, prompt, "r")
        assert sent.outcome == Outcome.RECOMPUTED and received.outcome == Outcome.RECOMPUTED
        assert [f.backend for f in sent.fallbacks] == ["disk"]
        assert tuple(tokens) == local.generate(prompt, GREEDY)[0].token_ids
        for llm in (prefill, decode):
            llm.engine.assert_no_leaks()
    finally:
        prefill.engine.connector.worker.close()
        decode.engine.connector.worker.close()

"""Two real engines in one process joined by a transfer chain (tiny model): the
decode-first hand-off the services run, step by step. Used by the CPU engine tests and the
GPU ones."""
from __future__ import annotations

import contextlib
import time

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer import KVTransferConfig, ReceiveParams, connector_factory
from pdserve.kvtransfer.codec import new_transfer_id

BLOCK = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def run_until(llm, done, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    outputs = []
    while not done():
        assert time.monotonic() < deadline, "engine did not finish in time"
        outputs += llm.step()
    return outputs


@contextlib.contextmanager
def engines(model_dir, config: KVTransferConfig, *, common: dict | None = None, **prefill_overrides):
    """(prefill, decode, local): two engines joined by `config`'s chain and a plain one
    (`common`: settings of all three, e.g. device); the connectors are closed on the way out."""
    common = dict(num_blocks=64, block_size=BLOCK, **(common or {}))
    prefill = LLM(str(model_dir), connector=connector_factory(config, listen=False),
                  **{**common, **prefill_overrides})
    decode = LLM(str(model_dir), connector=connector_factory(config), **common)
    try:
        yield prefill, decode, LLM(str(model_dir), **common)
    finally:
        prefill.engine.connector.worker.close()
        decode.engine.connector.worker.close()


def assert_all_blocks_back(prefill, decode) -> None:
    for llm in (prefill, decode):
        llm.engine.assert_no_leaks()
    assert decode.engine.connector.receives.sink.reserved_block_ids == set()


def disaggregated(prefill, decode, prompt, rid, after_first_step=lambda: None, stream_layers: bool = True,
                  lora_name: str | None = None):
    """One request, decode-first hand-off. Returns (tokens, sender verdict, receiver verdict).
    `stream_layers`: whether the prefill may send its KV layer by layer; `lora_name`: the
    adapter both engines run it under."""
    d_engine, p_engine = decode.engine, prefill.engine
    tid = new_transfer_id()
    d_engine.add_request(prompt, GREEDY, request_id=rid, remote_prefill=True,
                         transfer_params=ReceiveParams(tid), lora_name=lora_name)
    waiting = []
    run_until(decode, lambda: waiting or waiting.extend(d_engine.step()[1]))
    request = waiting[0]
    num_leading = max(0, request.num_cached_tokens) // BLOCK
    params = d_engine.connector.receives.prepare_receive(
        rid, d_engine.remote_block_ids(rid), len(prompt), num_leading, time.time() + 30, tid)

    p_engine.add_request(prompt, FIRST_TOKEN, request_id=f"p-{rid}", transfer_params=params,
                         stream_layers=stream_layers, lora_name=lora_name)
    outs = prefill.step()
    after_first_step()
    outs += run_until(prefill, lambda: not p_engine.has_unfinished())
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

"""A disaggregated request through two real engines in one process (tiny model, CPU).

The decode engine admits a remote-prefill request and allocates its blocks; its connector
reserves them (`prepare_receive`); the prefill engine computes the prompt and its connector
sends the blocks through the chain; the decode side settles the verdict and decodes. Greedy
tokens must equal a plain local engine's, and every block must be back in both pools.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.kvtransfer import KVTransferConfig, ReceiveParams, connector_factory
from pdserve.kvtransfer.codec import new_transfer_id
from pdserve.kvtransfer.backend_loader import is_importable
from pdserve.kvtransfer.verdict import RECOMPUTE, Landing
from engine_pair import BLOCK, GREEDY, assert_all_blocks_back, disaggregated, engines, run_until

def _params():
    out = ["disk"]
    for name in ("ucx", "nccl"):
        ok, why = is_importable(name)
        out.append(pytest.param(name, marks=pytest.mark.skipif(not ok, reason=f"{name}: {why}")))
    return out


@pytest.mark.parametrize("backend", _params())
def test_disaggregated_greedy_equals_local(tiny_model_factory, tmp_path, backend):
    model_dir = tiny_model_factory("llama")
    config = KVTransferConfig(backends=(backend, RECOMPUTE), disk_store=str(tmp_path / "store"))
    g = torch.Generator().manual_seed(4)  # a seed whose greedy continuation varies
    base = torch.randint(3, 256, (40,), generator=g).tolist()
    prompts = [base, base[:33] + [7, 8, 9, 10, 11]]  # the second shares 2 blocks with the first
    with engines(model_dir, config) as (prefill, decode, local):
        for i, prompt in enumerate(prompts):
            tokens, sent, received = disaggregated(prefill, decode, prompt, f"r{i}")
            assert sent.ok and sent.backend == backend and received.ok, received.describe()
            if backend == "disk":  # a store gets the prompt whole: gather + put + verdict
                assert sent.tail_s >= sent.duration_s > 0 and sent.num_messages == 0
            else:  # point to point: a message per layer (or the layers queued behind one)
                assert 1 <= sent.num_messages <= 2 and 0 < sent.tail_s and sent.layer_send_s > 0
            expected = local.generate(prompt, GREEDY)[0].token_ids
            assert tuple(tokens) == expected
        # the second prompt's first 2 blocks were a prefix hit on the decode side: not sent
        assert sent.num_blocks == 1
        assert_all_blocks_back(prefill, decode)


class ScriptedPolicy:
    """A thread policy that answers as the test sets it and records what the engine asked."""

    def __init__(self, base: int, burst: int) -> None:
        self.base, self.burst = base, burst
        self.others_idle = True
        self.asked: list[bool] = []  # `forward` of each step_threads call
        self.on_layer = lambda: None  # runs in each layer_threads call, before it answers

    def step_threads(self, forward: bool) -> int:
        self.asked.append(forward)
        return self.burst if forward and self.others_idle else self.base

    def layer_threads(self):
        self.on_layer()
        return None if self.others_idle else self.base


def test_decode_steps_take_the_count_their_policy_gives_and_tell_it_when_nothing_is_computed(
        tiny_model_factory, tmp_path):
    """The engine obeys its thread policy before each step, and tells it `forward=False` for a
    step with nothing to compute (every request waits on a remote prefill); the tokens are
    the same whatever the count."""
    model_dir = tiny_model_factory("llama")
    config = KVTransferConfig(backends=("disk", RECOMPUTE), disk_store=str(tmp_path / "store"))
    g = torch.Generator().manual_seed(5)
    prompt_a, prompt_b = (torch.randint(3, 256, (n,), generator=g).tolist() for n in (40, 24))
    before = torch.get_num_threads()
    policy = ScriptedPolicy(1, 2)
    decode = LLM(str(model_dir), connector=connector_factory(config), num_blocks=64, block_size=BLOCK,
                 num_threads=1, thread_policy=policy)
    try:
        d = decode.engine
        d.add_request(prompt_b, GREEDY, request_id="b", remote_prefill=True,
                      transfer_params=ReceiveParams(new_transfer_id()))
        run_until(decode, lambda: "b" in d.scheduler.remote)
        assert policy.asked and not any(policy.asked)  # nothing to compute: never a forward
        d.add_request(prompt_a, GREEDY, request_id="a")
        outputs = decode.step()
        assert policy.asked[-1] and d.num_threads == torch.get_num_threads() == 2
        policy.others_idle = False  # another engine of the machine started computing
        outputs += decode.step()
        assert d.num_threads == torch.get_num_threads() == 1
        assert d.abort("b")
        policy.others_idle = True
        outputs += run_until(decode, lambda: not d.has_unfinished())
        assert d.num_threads == 2
        d.idle()
        assert policy.asked[-1] is False and d.num_threads == 2  # told, but nothing runs: no change
        tokens = [t for o in outputs if o.request_id == "a" for t in o.new_token_ids]
        assert tuple(tokens) == LLM(str(model_dir), num_blocks=64, block_size=BLOCK).generate(
            prompt_a, GREEDY)[0].token_ids
        d.assert_no_leaks()
    finally:
        decode.engine.connector.worker.close()
        torch.set_num_threads(before)


def test_a_step_above_its_base_count_drops_to_it_at_the_next_layer_its_policy_says(tiny_model_factory):
    """The per-layer hook: a step running above its base count asks the policy before each
    layer; when another engine starts computing during layer 0, layers 1.. run on the base
    count, and so do later steps while it computes. Steps at the base count ask nothing per
    layer. The tokens are the same."""
    model_dir = tiny_model_factory("llama")
    prompt = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    before = torch.get_num_threads()
    policy = ScriptedPolicy(1, 2)
    llm = LLM(str(model_dir), num_blocks=64, block_size=BLOCK, num_threads=1, thread_policy=policy)
    try:
        e = llm.engine
        layers = e.runner.model.layers
        assert len(layers) >= 2
        seen: list[int] = []  # the threads each layer's first projection ran with
        layer_calls = []

        def watched(qkv):
            def call(x):
                seen.append(torch.get_num_threads())
                return qkv(x)
            return call

        def on_layer():
            layer_calls.append(len(seen))
            if len(seen) == 1:  # during layer 0 of the first step
                policy.others_idle = False

        policy.on_layer = on_layer
        for w in layers:
            w.qkv = watched(w.qkv)
        e.add_request(prompt, GREEDY, request_id="a")
        outputs = llm.step()
        assert seen == [2] + [1] * (len(layers) - 1)
        assert e.num_threads == torch.get_num_threads() == 1
        num_asked = len(layer_calls)
        outputs += run_until(llm, lambda: not e.has_unfinished())
        assert set(seen[len(layers):]) == {1} and len(layer_calls) == num_asked  # base steps: no per-layer check
        tokens = [t for o in outputs for t in o.new_token_ids]
        assert tuple(tokens) == LLM(str(model_dir), num_blocks=64, block_size=BLOCK).generate(
            prompt, GREEDY)[0].token_ids
        e.assert_no_leaks()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("backend", _params()[1:])
def test_a_prompt_added_without_layer_streaming_goes_whole_after_its_forward(tiny_model_factory, tmp_path, backend):
    """`stream_layers=False` (what a prefill worker asks when its forward takes the idle
    machine's cores): the prompt's KV goes in one message after the forward; with the
    default it streams per layer. Greedy tokens equal a local engine's either way."""
    model_dir = tiny_model_factory("llama")
    config = KVTransferConfig(backends=(backend, RECOMPUTE), disk_store=str(tmp_path / "store"))
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 256, (40,), generator=g).tolist()
    with engines(model_dir, config) as (prefill, decode, local):
        tokens, sent, received = disaggregated(prefill, decode, prompt, "whole", stream_layers=False)
        assert sent.ok and received.ok and sent.backend == backend
        assert sent.num_messages == 0  # whole: no layer messages
        assert tuple(tokens) == local.generate(prompt, GREEDY)[0].token_ids
        tokens, sent, received = disaggregated(prefill, decode, prompt + [5], "streamed")
        assert sent.ok and received.ok and sent.num_messages >= 1
        assert tuple(tokens) == local.generate(prompt + [5], GREEDY)[0].token_ids
        assert_all_blocks_back(prefill, decode)


def test_failed_transfer_is_recomputed_by_the_decode_side(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("llama")
    broken = tmp_path / "not-a-dir"
    broken.write_text("x")  # the store cannot be written: the chain ends in recompute
    config = KVTransferConfig(backends=("disk", RECOMPUTE), disk_store=str(broken))
    prefill = LLM(str(model_dir), connector=connector_factory(config, listen=False),
                  num_blocks=64, block_size=BLOCK)
    decode = LLM(str(model_dir), connector=connector_factory(config), num_blocks=64, block_size=BLOCK)
    local = LLM(str(model_dir), num_blocks=64, block_size=BLOCK)
    prompt = list(range(3, 40))
    try:
        tokens, sent, received = disaggregated(prefill, decode, prompt, "r")
        assert sent.landing == Landing.MISSING and received.landing == Landing.MISSING  # did not land
        assert [f.backend for f in sent.fallbacks] == ["disk"]
        assert tuple(tokens) == local.generate(prompt, GREEDY)[0].token_ids
        for llm in (prefill, decode):
            llm.engine.assert_no_leaks()
    finally:
        prefill.engine.connector.worker.close()
        decode.engine.connector.worker.close()


def _p2p_params():
    return [p for p in _params() if p != "disk"]


@pytest.mark.parametrize("backend", _p2p_params())
def test_layer_wise_stream_across_prefill_chunks(tiny_model_factory, tmp_path, backend):
    """A prompt prefilled in 12-token steps goes out as it computes: a step before the last
    sends the blocks it completed in one message, the last step its blocks layer by layer
    (the last, partial block with it); the decode accepts them only whole, and decodes what
    a local engine would."""
    model_dir = tiny_model_factory("llama")
    config = KVTransferConfig(backends=(backend, RECOMPUTE))
    prompt = torch.randint(3, 256, (45,), generator=torch.Generator().manual_seed(5)).tolist()
    with engines(model_dir, config, max_num_tokens=12) as (prefill, decode, local):
        num_layers = prefill.engine.model_config.num_layers
        tokens, sent, received = disaggregated(prefill, decode, prompt, "chunked")
        assert sent.ok and received.ok, received.describe()
        # steps end at tokens 12, 24, 36, 45: blocks complete after steps 2 (block 0), 3 (1)
        # and 4 (2, the partial block, sent a layer at a time unless the sender lags)
        assert sent.num_blocks == 3 and 2 + 1 <= sent.num_messages <= 2 + num_layers
        assert tuple(tokens) == local.generate(prompt, GREEDY)[0].token_ids
        assert_all_blocks_back(prefill, decode)


@pytest.mark.parametrize("backend", _p2p_params())
def test_a_stream_that_breaks_falls_back_to_the_next_backend_whole(tiny_model_factory, tmp_path, backend):
    """The receiver's transport goes away after the first prefill step: the stream breaks, and
    the whole prompt goes through the disk store instead (built from the parts the stream
    kept); the decode lands it over the layers that had arrived, and decodes as a local
    engine would."""
    model_dir = tiny_model_factory("llama")
    config = KVTransferConfig(backends=(backend, "disk", RECOMPUTE), disk_store=str(tmp_path / "store"),
                              step_timeout_s=5)
    prompt = torch.randint(3, 256, (45,), generator=torch.Generator().manual_seed(6)).tolist()
    with engines(model_dir, config, max_num_tokens=20) as (prefill, decode, local):
        def cut_the_link():
            assert prefill.engine.connector.worker.flush(10)  # the first step's layers landed
            decode.engine.connector.receives.backends.transports[backend].close()

        tokens, sent, received = disaggregated(prefill, decode, prompt, "broken", cut_the_link)
        assert sent.ok and sent.backend == "disk" and received.ok, received.describe()
        assert [f.backend for f in sent.fallbacks] == [backend]
        assert "stream broke at layers [0, 2) of blocks [1, 2)" in sent.fallbacks[0].reason
        assert tuple(tokens) == local.generate(prompt, GREEDY)[0].token_ids
        assert_all_blocks_back(prefill, decode)


@pytest.mark.parametrize("backend", _p2p_params()[:1])
def test_layerwise_benchmark_smoke(tiny_model_factory, backend, capsys):
    """`pdserve bench layerwise` end to end on the tiny model (a smoke test, not a timing)."""
    from pdserve.bench import layerwise

    threads = torch.get_num_threads()
    try:
        rc = layerwise.main(["--model", str(tiny_model_factory("llama")), "--prompt-len", "45",
                             "--step-tokens", "12", "--repeats", "2", "--backends", backend])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    streamed = next(line.split() for line in lines if line.startswith(backend) and "layerwise" in line)
    whole = next(line.split() for line in lines if line.startswith(backend) and " whole " in line)
    assert 3 <= int(streamed[6]) <= 4 and float(streamed[4]) > 0  # 2 steps whole, the last per layer
    assert whole[4] == "-" and int(whole[6]) == 0


@pytest.mark.parametrize("backend", _p2p_params())
def test_a_payload_altered_in_flight_fails_its_mac_and_falls_back(tiny_model_factory, tmp_path, backend,
                                                                  monkeypatch):
    """With a transfer key, each payload chunk carries its AEAD tag under its request's frame
    number: bytes that differ on arrival from what the sender sealed are refused at the decode
    before its sink sees them, a transfer failure like corrupt data, so the chain goes on (to
    the disk store) and the decode decodes what a local engine would."""
    import os

    from pdserve.kvtransfer.backends import _payload

    model_dir = tiny_model_factory("llama")
    config = KVTransferConfig(backends=(backend, "disk", RECOMPUTE), disk_store=str(tmp_path / "store"),
                              step_timeout_s=5, transfer_key=os.urandom(32), store_key=os.urandom(32))
    seal = _payload.seal_chunk

    def altered_after_sealing(cipher, chunk, plaintext, out):
        seal(cipher, chunk, plaintext, out)
        out[0] ^= 1  # what arrives differs from what was sealed

    monkeypatch.setattr(_payload, "seal_chunk", altered_after_sealing)
    prompt = torch.randint(3, 256, (45,), generator=torch.Generator().manual_seed(7)).tolist()
    with engines(model_dir, config, max_num_tokens=20) as (prefill, decode, local):
        tokens, sent, received = disaggregated(prefill, decode, prompt, "altered")
        assert sent.ok and sent.backend == "disk" and received.ok, received.describe()
        assert [f.backend for f in sent.fallbacks] == [backend]
        assert "payload failed its AEAD tag" in sent.fallbacks[0].reason, sent.fallbacks[0].reason
        assert tuple(tokens) == local.generate(prompt, GREEDY)[0].token_ids
        assert_all_blocks_back(prefill, decode)

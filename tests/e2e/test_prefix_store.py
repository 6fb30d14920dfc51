"""A persistent prefix store through the whole system, across a restart of every service.

Router, prefill and decode run as real processes with `--prefix-store disk`. A prompt goes
through the HTTP API; every service is stopped and started again on the same store; the
same prompt then gives identical text, and its full prompt blocks are loaded from the store
by the decode before it asks for a prefill (usage's cached tokens), so only the last,
partial block crosses the transfer. No block is left held anywhere.
"""
from __future__ import annotations

import pytest
from harness import MODEL, deploy_workers, secret_file

pytestmark = pytest.mark.slow

BLOCK = 16
PROMPT = ("A short story about a lighthouse keeper who finds a message in a bottle. It begins "
          "on a stormy night, when the waves are high and the lamp is the only light for miles. "
          "The keeper climbs the stairs and")


def start(store: str, backend: str, secret: str):
    flags = ["--kv-backends", backend, "--disk-store", store, "--prefix-store", "disk",
             "--failure-policy", "fail"]
    return deploy_workers([("prefill-0", "prefill", flags), ("decode-0", "decode", flags)],
                          router_args=["--local-prefill-threshold", "0", "--static-routing"], secret_path=secret)


def complete(deployment):
    out = deployment.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                                 temperature=0)
    info = out.model_extra["pdserve"]
    assert info["timings"]["transfer_ms"] > 0  # the transfer's tail, per request
    return out.choices[0].text, out.usage, info["transfer"]


def test_text_is_identical_after_a_restart_and_the_prompt_is_loaded_not_computed(tmp_path):
    from pdserve.deploy import up
    from pdserve.kvtransfer.backend_loader import is_importable

    backend = "ucx" if is_importable("ucx")[0] else "disk"
    store, secret = str(tmp_path / "kv"), secret_file()  # store records carry the secret's MAC
    first = start(store, backend, secret)
    try:
        text0, usage0, transfer0 = complete(first)
        first.assert_no_leaks()
    finally:
        up.stop(first.children)
    num_full = (usage0.prompt_tokens - 1) // BLOCK  # a prompt's last token is always computed
    num_blocks = -(-usage0.prompt_tokens // BLOCK)
    assert num_full >= 2
    assert usage0.prompt_tokens_details.cached_tokens == 0  # the store started empty
    assert transfer0["outcome"] == "transferred" and transfer0["blocks"] == num_blocks

    second = start(store, backend, secret)
    try:
        text1, usage1, transfer1 = complete(second)
        second.assert_no_leaks()
    finally:
        up.stop(second.children)
    assert text1 == text0
    assert usage1.prompt_tokens_details.cached_tokens == num_full * BLOCK
    assert transfer1["outcome"] == "transferred"
    assert transfer1["blocks"] == num_blocks - num_full  # only the tail crossed


LONG_PROMPT = " ".join(f"Entry {i}: the keeper logged the wind, the tide and the lamp's oil." for i in range(24))


def _cached_counter(deployment) -> float:
    import httpx

    metrics = httpx.get(deployment.base_url.replace("/v1", "/metrics"), timeout=10).text
    line = next(l for l in metrics.splitlines() if l.startswith('pdserve_router_prompt_tokens_total{kind="cached"}'))
    return float(line.split()[-1])


def _grpc_usage(deployment, prompt: str):
    import grpc

    from pdserve.proto.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    request = generation_pb2.GenerateRequest(model=MODEL, prompt=prompt,
                                             sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0))
    with grpc.insecure_channel(f"127.0.0.1:{deployment.grpc_port}") as channel:
        last = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120))[-1]
    return last.usage


def test_prompt_tokens_the_prefill_loads_from_its_store_count_as_cached(tmp_path):
    """Only the prefill service uses the store: after a restart it loads the long prompt's
    blocks instead of computing them, and usage (HTTP, gRPC) and the router's cached-token
    counter say so."""
    from pdserve.deploy import up
    from pdserve.kvtransfer.backend_loader import is_importable

    backend = "ucx" if is_importable("ucx")[0] else "disk"
    store, secret = str(tmp_path / "kv"), secret_file()
    common = ["--kv-backends", backend, "--disk-store", store, "--failure-policy", "fail"]

    def start_prefill_store():
        return deploy_workers([("prefill-0", "prefill", [*common, "--prefix-store", "disk"]),
                               ("decode-0", "decode", common)],
                              router_args=["--local-prefill-threshold", "0", "--static-routing"], secret_path=secret)

    first = start_prefill_store()
    try:
        out = first.openai().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4, temperature=0)
        assert out.usage.prompt_tokens_details.cached_tokens == 0  # the store started empty
        first.assert_no_leaks()
    finally:
        up.stop(first.children)
    num_prompt = out.usage.prompt_tokens
    assert num_prompt > 200

    second = start_prefill_store()
    try:
        http = second.openai().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4, temperature=0)
        assert http.model_extra["pdserve"]["transfer"]["outcome"] == "transferred"
        assert http.choices[0].text == out.choices[0].text
        assert http.usage.prompt_tokens_details.cached_tokens >= 0.9 * num_prompt
        via_grpc = _grpc_usage(second, LONG_PROMPT)
        assert via_grpc.cached_prompt_tokens >= 0.9 * num_prompt
        assert _cached_counter(second) == (http.usage.prompt_tokens_details.cached_tokens
                                           + via_grpc.cached_prompt_tokens)
        second.assert_no_leaks()
    finally:
        up.stop(second.children)

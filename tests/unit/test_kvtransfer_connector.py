"""The pdserve connector halves, stepped by hand in the order the engine calls them
(engine/connector.py), over real caches and a real disk store."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from pdserve.engine.connector import ConnectorRequest, LayerSaveContext
from pdserve.kvtransfer import KVTransferConfig
from pdserve.kvtransfer.connector import build_connector
from pdserve.kvtransfer.params import ReceiveParams, TransferParams
from kvcaches import block_digests, make_caches, tiny_layout
from pdserve.kvtransfer.verdict import RECOMPUTE, Landing
from pdserve.common.block_hash import hash_prompt_blocks

LAYOUT = tiny_layout(num_blocks=32, block_size=4)
PROMPT = tuple(range(3, 17))  # 14 tokens: 3 full blocks + 2 tokens


def request(rid: str, params=None, prompt=PROMPT) -> ConnectorRequest:
    hashes = hash_prompt_blocks(prompt, LAYOUT.block_size, LAYOUT.compatibility_hash())
    return ConnectorRequest(rid, prompt, tuple(hashes), params)


def make(tmp_path, prefix_cache: str | None = "disk", backends=("disk", RECOMPUTE)):
    config = KVTransferConfig(backends=backends, disk_store=str(tmp_path / "store"),
                              prefix_cache=prefix_cache)
    conn = build_connector(config, LAYOUT, listen=False)
    caches = make_caches(LAYOUT)
    conn.worker.register_kv_caches(caches, LAYOUT)
    return conn, caches


def admit(conn, req: ConnectorRequest, block_ids: list[int], num_computed: int = 0) -> int:
    """What the scheduler does when it admits `req`: ask for matches, allocate, tell."""
    num_external = conn.scheduler.get_num_new_matched_tokens(req, num_computed)
    conn.scheduler.update_state_after_alloc(req, block_ids, num_external)
    return num_external


def forward(conn, caches, block_ids: dict[str, list[int]], num_computed: dict[str, int], seed=0):
    """One engine step's worker side: loads, a 'forward' that writes fresh values into the
    scheduled blocks, per-layer saves, wait_for_save."""
    conn.worker.start_load_kv(conn.scheduler.build_connector_meta())
    gen = torch.Generator().manual_seed(seed)
    for ids in block_ids.values():
        for cache in caches:
            for b in ids:
                if not cache[b].any():  # loaded blocks keep their contents
                    cache[b] = torch.randn(cache[b].shape, generator=gen)
    ctx = LayerSaveContext({r: tuple(ids) for r, ids in block_ids.items()}, num_computed)
    for i, cache in enumerate(caches):
        conn.worker.wait_for_layer_load(i)
        conn.worker.save_kv_layer(i, cache, ctx)
    conn.worker.wait_for_save()


def test_prefix_cache_saves_then_a_fresh_instance_loads(tmp_path):
    conn1, caches1 = make(tmp_path)
    req = request("a")
    assert conn1.scheduler.get_num_new_matched_tokens(req, 0) == 0
    conn1.scheduler.update_state_after_alloc(req, [5, 6, 7, 8], 0)
    forward(conn1, caches1, {"a": [5, 6, 7, 8]}, {"a": 14})
    assert conn1.worker.flush(10)
    assert conn1.scheduler.request_finished(req, [5, 6, 7, 8]) is False  # nothing to wait for
    assert len(list((tmp_path / "store").rglob("*.kv"))) == 3  # the full blocks only
    conn1.worker.close()

    conn2, caches2 = make(tmp_path)
    # all 3 full blocks hit; the engine always computes at least the last prompt token
    assert conn2.scheduler.get_num_new_matched_tokens(req, 0) == 12
    conn2.scheduler.update_state_after_alloc(req, [9, 10, 11, 12], 12)
    forward(conn2, caches2, {"a": [9, 10, 11, 12]}, {"a": 14})
    assert block_digests(caches2, [9, 10, 11]) == block_digests(caches1, [5, 6, 7])
    # with a local prefix hit of one block, the store supplies the next two
    assert conn2.scheduler.get_num_new_matched_tokens(request("b"), 4) == 8
    conn2.worker.close()


def test_prompt_of_exact_blocks_leaves_the_last_block_to_compute(tmp_path):
    prompt = tuple(range(3, 11))  # 8 tokens = 2 full blocks
    conn, caches = make(tmp_path)
    req = request("a", prompt=prompt)
    conn.scheduler.get_num_new_matched_tokens(req, 0)
    forward(conn, caches, {"a": [1, 2]}, {"a": 8})
    conn.worker.flush(10)
    fresh, _ = make(tmp_path)
    assert fresh.scheduler.get_num_new_matched_tokens(request("b", prompt=prompt), 0) == 4
    conn.worker.close()
    fresh.worker.close()


def test_remote_prefill_requests_get_no_store_load(tmp_path):
    conn, _ = make(tmp_path)
    assert conn.scheduler.get_num_new_matched_tokens(
        request("d", ReceiveParams(bytes(16))), 0) == 0
    conn.worker.close()


def handoff_pair(tmp_path):
    """A prefill-side and a decode-side connector sharing a disk store (the chain's only
    backend besides recompute), each with its own cache."""
    prefill, p_caches = make(tmp_path, prefix_cache=None)
    decode, d_caches = make(tmp_path, prefix_cache=None)
    return prefill, p_caches, decode, d_caches


def test_prefill_sends_into_the_decode_cache(tmp_path):
    prefill, p_caches, decode, d_caches = handoff_pair(tmp_path)
    params = decode.receives.prepare_receive("d1", [20, 21, 22, 23, 24], num_prompt_tokens=14,
                                           num_leading_blocks=1, deadline=time.time() + 30)
    assert params.dst_block_ids == (21, 22, 23)  # block 0 is the decode side's own prefix hit
    assert decode.receives.sink.reserved_block_ids == {21, 22, 23}

    req = request("p1", params)
    assert admit(prefill, req, [2, 3, 4, 5]) == 0
    forward(prefill, p_caches, {"p1": [2, 3, 4, 5]}, {"p1": 8})  # first chunk: not done yet
    assert prefill.sends.wait_verdict("p1", 0.2) is None
    forward(prefill, p_caches, {"p1": [2, 3, 4, 5]}, {"p1": 14})  # prompt complete: send
    verdict = prefill.sends.wait_verdict("p1", 10)
    assert verdict.ok and verdict.backend == "disk" and verdict.num_blocks == 3
    assert verdict.fetch_keys[:2] == req.block_hashes[1:] and verdict.fetch_keys[2] < 0
    assert prefill.scheduler.request_finished(req, [2, 3, 4, 5]) is True  # keep until reported
    assert prefill.worker.get_finished({"p1"}) == {"p1"}

    final = decode.receives.complete_receive("d1", verdict)
    assert final.ok
    assert block_digests(d_caches, [21, 22, 23]) == block_digests(p_caches, [3, 4, 5])
    assert decode.receives.sink.pending_transfer_ids == set()
    assert decode.receives.sink.reserved_block_ids == set()
    prefill.worker.close()
    decode.worker.close()


def test_a_send_is_reported_once_the_engine_ended_its_request(tmp_path):
    """Each end is told to the worker once (get_finished's ids); a send done before that
    is held until then, and reported once."""
    prefill, p_caches, decode, _ = handoff_pair(tmp_path)
    params = decode.receives.prepare_receive("d1", [20, 21, 22, 23], 14, 0, time.time() + 30)
    req = request("p1", params)
    admit(prefill, req, [2, 3, 4, 5])
    forward(prefill, p_caches, {"p1": [2, 3, 4, 5]}, {"p1": 14})
    assert prefill.worker.flush(10)
    assert prefill.worker.get_finished(set()) == set()  # done, but the engine has not ended p1
    assert prefill.scheduler.request_finished(req, [2, 3, 4, 5])  # the first token ended p1
    assert prefill.worker.get_finished({"p1"}) == {"p1"}
    assert prefill.worker.get_finished(set()) == set()
    verdict = prefill.sends.wait_verdict("p1", 1)
    assert verdict is not None and verdict.ok, verdict
    assert prefill.sends.wait_verdict("p1", 0.2) is None  # and no second one
    decode.receives.cancel_receive("d1")
    assert decode.receives.sink.reserved_block_ids == set()
    prefill.worker.close()
    decode.worker.close()


def test_a_request_that_ends_before_its_send_reaches_the_worker_keeps_no_blocks(tmp_path):
    prefill, _, decode, _ = handoff_pair(tmp_path)
    params = decode.receives.prepare_receive("d1", [20, 21, 22, 23], 14, 0, time.time() + 30)
    req = request("p1", params)
    admit(prefill, req, [2, 3, 4, 5])  # announced, never handed to the worker half
    assert prefill.scheduler.request_finished(req, [2, 3, 4, 5]) is False
    assert prefill.scheduler.build_connector_meta().sends == []
    decode.receives.cancel_receive("d1")
    prefill.worker.close()
    decode.worker.close()


def test_abort_before_the_prompt_completes_reports_an_aborted_verdict(tmp_path):
    prefill, p_caches, decode, _ = handoff_pair(tmp_path)
    params = decode.receives.prepare_receive("d1", [20, 21, 22, 23], 14, 0, time.time() + 30)
    req = request("p1", params)
    admit(prefill, req, [2, 3, 4, 5])
    forward(prefill, p_caches, {"p1": [2, 3, 4, 5]}, {"p1": 4})
    assert prefill.scheduler.request_finished(req, [2, 3, 4, 5]) is True
    assert prefill.worker.get_finished({"p1"}) == {"p1"}
    verdict = prefill.sends.wait_verdict("p1", 1)
    assert verdict.landing == Landing.ABORTED and not verdict.ok

    final = decode.receives.complete_receive("d1", verdict)
    assert final.landing == Landing.ABORTED
    assert decode.receives.sink.reserved_block_ids == set()
    prefill.worker.close()
    decode.worker.close()


def test_service_abort_before_the_send_starts(tmp_path):
    prefill, p_caches, decode, _ = handoff_pair(tmp_path)
    params = decode.receives.prepare_receive("d1", [20, 21, 22, 23], 14, 0, time.time() + 30)
    req = request("p1", params)
    admit(prefill, req, [2, 3, 4, 5])
    forward(prefill, p_caches, {"p1": [2, 3, 4, 5]}, {"p1": 4})
    assert prefill.sends.abort_send("p1") and not prefill.sends.abort_send("p1")
    assert prefill.sends.wait_verdict("p1", 1).landing == Landing.ABORTED
    forward(prefill, p_caches, {"p1": [2, 3, 4, 5]}, {"p1": 14})  # too late: nothing is sent
    assert prefill.worker.flush(5) and not list((tmp_path / "store").rglob("*.kv"))
    assert prefill.scheduler.request_finished(req, [2, 3, 4, 5])
    assert prefill.worker.get_finished({"p1"}) == {"p1"}
    assert prefill.worker.get_finished(set()) == set()
    decode.receives.cancel_receive("d1")
    prefill.worker.close()
    decode.worker.close()


def test_incompatible_or_mis_sized_handoffs_fail_without_sending(tmp_path):
    prefill, p_caches, decode, _ = handoff_pair(tmp_path)
    params = decode.receives.prepare_receive("d1", [20, 21, 22, 23], 14, 0, time.time() + 30)
    for rid, bad, why in (("p1", replace(params, compat_hash=params.compat_hash ^ 1), "compatibility"),
                          ("p2", replace(params, dst_block_ids=(20, 21)), "reserved 2 blocks")):
        req = request(rid, bad)
        admit(prefill, req, [2, 3, 4, 5])
        forward(prefill, p_caches, {rid: [2, 3, 4, 5]}, {rid: 14})
        verdict = prefill.sends.wait_verdict(rid, 5)
        assert verdict.landing == Landing.MISSING and verdict.fallbacks[0].backend == "sender"
        assert why in verdict.fallbacks[0].reason
    assert decode.receives.complete_receive("d1", verdict).landing == Landing.MISSING
    assert not list((tmp_path / "store").rglob("*.kv"))  # nothing was sent
    prefill.worker.close()
    decode.worker.close()


def test_receive_api_guards(tmp_path):
    decode, _ = make(tmp_path, prefix_cache=None)
    decode.receives.prepare_receive("d1", [1, 2], 8, 0, time.time() + 30)
    with pytest.raises(ValueError):
        decode.receives.prepare_receive("d1", [3, 4], 8, 0, time.time() + 30)
    with pytest.raises(ValueError):
        decode.receives.complete_receive("nope", None)
    assert decode.receives.cancel_receive("d1") and not decode.receives.cancel_receive("d1")
    assert decode.receives.sink.reserved_block_ids == set()
    decode.worker.close()
    decode.worker.close()  # idempotent


def test_transfer_params_are_validated():
    with pytest.raises(ValueError):
        TransferParams(b"short", (1,), 0, 0.0, 1)
    with pytest.raises(ValueError):
        TransferParams(bytes(16), (1, 1), 0, 0.0, 1)
    with pytest.raises(ValueError):
        TransferParams(bytes(16), (1,), -1, 0.0, 1)

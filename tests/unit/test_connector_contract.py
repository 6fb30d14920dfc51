"""The connector contract (engine/connector.py), held by the real engine and scheduler.

A scripted connector stands in for the transfer layer: its scheduler half offers loads and
keeps finished requests' blocks as told, its worker half records what the engine hands it
and reports sends done when the test says so. The engine is real (a tiny random model on
CPU). Paths: a remote prefill (after a store load) finished, aborted, or failed and
recomputed; a kept send released by `get_finished`; a connector load. Each ends with every block back in the pool.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from pdserve.engine.connector import (
    Connector, ConnectorMetadata, KVConnectorScheduler, KVConnectorWorker,
)
from pdserve.engine.llm import LLM
from pdserve.engine.request import RequestStatus
from pdserve.engine.sampling_params import SamplingParams

BLOCK = 16
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
PROMPT = [(7 * i + 3) % 200 + 1 for i in range(3 * BLOCK + 5)]  # 3 full blocks + 5 tokens


@dataclass(slots=True)
class ScriptedMeta(ConnectorMetadata):
    loads: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)  # rid, blocks, tokens
    finished: list[tuple[str, bool]] = field(default_factory=list)  # rid, kept


class ScriptedScheduler(KVConnectorScheduler):
    def __init__(self) -> None:
        self.offer: dict[str, int] = {}  # rid -> tokens to offer as loaded
        self.keep: set[str] = set()  # rids whose blocks a send still reads after they finish
        self.asked: list[str] = []
        self.finished_calls: list[tuple[str, bool]] = []  # (rid, kept), in call order
        self._meta = ScriptedMeta()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.asked.append(request.request_id)
        return self.offer.get(request.request_id, 0)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self._meta.loads.append((request.request_id, tuple(block_ids), num_external_tokens))

    def build_connector_meta(self):
        meta, self._meta = self._meta, ScriptedMeta()
        meta.request_ids = sorted({rid for rid, *_ in (*meta.loads, *meta.finished)})
        return meta

    def request_finished(self, request, block_ids):
        kept = request.request_id in self.keep
        self.finished_calls.append((request.request_id, kept))
        self._meta.finished.append((request.request_id, kept))
        return kept


class ScriptedWorker(KVConnectorWorker):
    def __init__(self) -> None:
        self.metas: list[ScriptedMeta] = []
        self.saved_layers: list[int] = []
        self.done_sends: set[str] = set()  # what the next get_finished reports
        self.told_finished: set[str] = set()

    def register_kv_caches(self, kv_caches, layout):
        self.layout = layout

    def start_load_kv(self, metadata):
        self.metas.append(metadata)

    def wait_for_layer_load(self, layer_idx):
        pass

    def save_kv_layer(self, layer_idx, kv_layer, context):
        self.saved_layers.append(layer_idx)

    def wait_for_save(self):
        pass

    def get_finished(self, finished_request_ids):
        self.told_finished |= finished_request_ids
        done, self.done_sends = self.done_sends, set()
        return done


@pytest.fixture
def scripted(tiny_model_factory):
    sched, worker = ScriptedScheduler(), ScriptedWorker()
    llm = LLM(str(tiny_model_factory("llama")), connector=Connector(sched, worker),
              num_blocks=32, block_size=BLOCK)
    yield llm.engine, sched, worker
    llm.engine.assert_no_leaks()


def step_until(engine, done, timeout_s: float = 60.0):
    deadline, outputs, waiting = time.monotonic() + timeout_s, [], []
    while not done(outputs, waiting):
        assert time.monotonic() < deadline, "engine did not reach the state in time"
        out, ready = engine.step()
        outputs += out
        waiting += ready
    return outputs, waiting


def tokens_of(outputs, rid):
    return [t for o in outputs if o.request_id == rid for t in o.new_token_ids]


def local_tokens(engine, rid="local"):
    engine.add_request(PROMPT, GREEDY, request_id=rid)
    outs, _ = step_until(engine, lambda o, w: not engine.has_unfinished())
    return tokens_of(outs, rid)


def park_remote(engine, rid):
    engine.add_request(PROMPT, GREEDY, request_id=rid, remote_prefill=True)
    _, waiting = step_until(engine, lambda o, w: w)
    assert [r.request_id for r in waiting] == [rid]
    assert waiting[0].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return waiting[0]


def test_remote_prefill_finished_decodes_from_the_given_first_token(scripted):
    engine, sched, worker = scripted
    free_before = engine.kv.get_num_free_blocks()
    sched.offer["r"] = BLOCK  # a persistent store holds the first block
    request = park_remote(engine, "r")
    assert request.num_computed_tokens == BLOCK  # the prefill fills only what follows
    assert [load[2] for m in worker.metas for load in m.loads if load[0] == "r"] == [BLOCK]
    assert engine.stats().num_waiting_remote == 1
    assert len(engine.remote_block_ids("r")) == 4  # the whole prompt's blocks are held
    assert free_before - engine.kv.get_num_free_blocks() >= 4
    assert worker.saved_layers == []  # no forward ran for it
    assert engine.finish_remote_prefill("r", 42)
    assert not engine.finish_remote_prefill("r", 42)  # ended once
    outs, _ = step_until(engine, lambda o, w: not engine.has_unfinished())
    tokens = tokens_of(outs, "r")
    assert tokens[0] == 42 and len(tokens) == GREEDY.max_tokens
    assert outs[-1].num_loaded_tokens == BLOCK and outs[-1].num_external_tokens == len(PROMPT)
    assert ("r", False) in sched.finished_calls and "r" in worker.told_finished


def test_remote_prefill_aborted_while_waiting_frees_its_blocks(scripted):
    engine, sched, worker = scripted
    park_remote(engine, "a")
    assert engine.abort("a")
    assert engine.kv.get_num_free_blocks() == engine.kv.get_max_resource_count()
    assert not engine.finish_remote_prefill("a", 1) and not engine.recompute_remote_prefill("a")
    outs, _ = step_until(engine, lambda o, w: not engine.has_unfinished())
    assert [o.finish_reason for o in outs if o.request_id == "a"] == ["abort"]
    assert ("a", False) in sched.finished_calls


def test_remote_prefill_failed_recomputes_here_with_the_same_greedy_output(scripted):
    engine, sched, worker = scripted
    expected = local_tokens(engine)
    park_remote(engine, "f")
    assert engine.recompute_remote_prefill("f")
    outs, _ = step_until(engine, lambda o, w: not engine.has_unfinished())
    assert tokens_of(outs, "f") == expected
    assert worker.saved_layers  # the prompt's forward ran here


def test_kept_blocks_wait_for_the_send_reported_by_get_finished(scripted):
    engine, sched, worker = scripted
    sched.keep.add("s")
    engine.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0.0), request_id="s")
    step_until(engine, lambda o, w: any(x.request_id == "s" and x.finished for x in o))
    assert engine.kv.blocks_of("s")  # the send still reads them
    assert engine.has_unfinished()
    engine.step()
    assert engine.kv.blocks_of("s")  # not reported yet: still held
    worker.done_sends = {"s"}
    engine.step()
    assert not engine.kv.blocks_of("s") and not engine.has_unfinished()
    assert ("s", True) in sched.finished_calls


def test_kept_blocks_of_an_aborted_request_wait_for_the_report_too(scripted):
    engine, sched, worker = scripted
    sched.keep.add("k")
    engine.add_request(PROMPT, GREEDY, request_id="k")
    engine.step()
    assert engine.abort("k")
    assert engine.kv.blocks_of("k")
    worker.done_sends = {"k"}
    step_until(engine, lambda o, w: not engine.has_unfinished())


def test_offered_tokens_are_loaded_in_the_admitting_step_before_its_forward(scripted):
    engine, sched, worker = scripted
    sched.offer["l"] = 2 * BLOCK
    engine.add_request(PROMPT, GREEDY, request_id="l")
    engine.step()
    loads = [(m, load) for m in worker.metas for load in m.loads if load[0] == "l"]
    assert len(loads) == 1
    _, (_, block_ids, num_tokens) = loads[0]
    assert num_tokens == 2 * BLOCK and len(block_ids) >= 2
    request = engine.scheduler.find("l")
    assert request.num_external_tokens == 2 * BLOCK
    assert request.num_computed_tokens == len(PROMPT)  # only the rest was computed
    outs, _ = step_until(engine, lambda o, w: not engine.has_unfinished())
    assert outs[-1].num_external_tokens == 2 * BLOCK

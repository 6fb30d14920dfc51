"""Scheduler, stepped without a model: token budgets, chunking, capacity policies, endings.

A `Driver` does what the engine does after each step (advance `num_computed_tokens`,
publish blocks, append a token where a chunk reaches the end, finish at max_tokens), with
token 7 standing in for whatever the model would have produced.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import CacheConfig, CapacityPolicy, ChunkingPolicy, ModelConfig, SchedulerConfig
from pdserve.engine.connector import NoopConnectorScheduler
from pdserve.common.errors import CapacityError
from pdserve.engine.block_pool import NULL_BLOCK_ID
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.common.block_hash import hash_prompt_blocks

BS = 8
MODEL = ModelConfig(architecture="llama", vocab_size=100, hidden_size=16, intermediate_size=32,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                    max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0)


class Driver:
    def __init__(self, num_blocks: int = 64, max_model_len: int = 1024, window: int | None = None,
                 **sched) -> None:
        cache = CacheConfig(block_size=BS, num_blocks=num_blocks, attention_window=window)
        self.kv = KVCacheManager(MODEL, cache, torch.device("cpu"))
        self.sched = Scheduler(SchedulerConfig(**sched), self.kv, NoopConnectorScheduler(), max_model_len)
        self.finished: list[Request] = []

    def add(self, rid: str, prompt_len: int, max_tokens: int = 4, first_token: int = 1,
            remote: bool = False) -> Request:
        prompt = list(range(first_token, first_token + prompt_len))
        r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), remote_prefill=remote)
        r.block_hashes = hash_prompt_blocks(prompt, BS, salt=1)
        self.sched.add(r)
        return r

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        assert out.num_tokens <= self.sched.config.max_num_tokens or len(out.chunks) == 1
        for chunk in out.chunks:
            req = chunk.request
            assert chunk.start == req.num_computed_tokens
            req.num_computed_tokens = chunk.start + chunk.num_new_tokens
            self.kv.update_resources(req)
            if chunk.samples_token:
                req.output_token_ids.append(7)
                if req.num_output_tokens >= req.sampling_params.max_tokens:
                    self.sched.finish(req, RequestStatus.FINISHED_LENGTH)
                    self.finished.append(req)
        return out

    def run(self, max_steps: int = 500) -> list[SchedulerOutput]:
        outs = []
        while self.sched.num_unfinished:
            outs.append(self.step())
            assert len(outs) < max_steps, "the scheduler stopped making progress"
        self.kv.assert_all_free()
        return outs


def shape(out: SchedulerOutput) -> dict[str, int]:
    return {c.request.request_id: c.num_new_tokens for c in out.chunks}


def test_decodes_go_first_then_prefills_within_the_budget():
    d = Driver(max_num_tokens=20)
    d.add("a", 10)
    assert shape(d.step()) == {"a": 10}
    d.add("b", 30, first_token=50)
    out = d.step()
    assert shape(out) == {"a": 1, "b": 19}  # a decodes; b gets what is left, chunked
    assert [c.request.request_id for c in out.chunks] == ["a", "b"]
    assert not out.chunks[1].samples_token
    assert shape(d.step()) == {"a": 1, "b": 11}
    assert d.step().chunks[-1].request.request_id == "b"
    d.run()
    assert all(r.num_output_tokens == 4 for r in d.finished)


def test_unchunked_prompt_waits_for_a_step_of_its_own():
    d = Driver(max_num_tokens=16, enable_chunked_prefill=False)
    d.add("a", 4)
    d.add("b", 40, first_token=20)  # longer than the budget
    assert shape(d.step()) == {"a": 4}  # b cannot share this step, and is never cut
    assert shape(d.step()) == {"a": 1}
    d.sched.finish(d.sched.running[0], RequestStatus.FINISHED_ABORTED)
    assert shape(d.step()) == {"b": 40}  # alone: the whole prompt, over budget
    d.run()


def test_first_come_first_served_finishes_the_oldest_prompt_first():
    d = Driver(max_num_tokens=32)
    for i in range(3):
        d.add(f"r{i}", 40, first_token=100 * i + 1)
    assert shape(d.step()) == {"r0": 32}
    assert shape(d.step()) == {"r0": 8, "r1": 24}
    d.run()


def test_equal_progress_shares_the_budget():
    d = Driver(max_num_tokens=32, chunking_policy=ChunkingPolicy.EQUAL_PROGRESS)
    for i in range(4):
        d.add(f"r{i}", 40, first_token=100 * i + 1)
    first = shape(d.step())
    assert first == {"r0": 8, "r1": 8, "r2": 8, "r3": 8}
    assert shape(d.step()) == {"r0": 8, "r1": 8, "r2": 8, "r3": 8}
    d.run()


def test_shortest_first_runs_a_short_prompt_in_a_step_sized_for_it():
    """A 40-token prompt that arrives with, or behind, a 2,000-token one runs first, in a
    step of at most 50 prompt tokens; the long one gets what is left, then whole steps."""
    d = Driver(max_num_tokens=256, chunking_policy=ChunkingPolicy.SHORTEST_FIRST,
               max_model_len=4096, num_blocks=300)
    d.add("long", 2000, max_tokens=1)
    d.add("short", 40, max_tokens=1, first_token=3000)
    assert shape(d.step()) == {"short": 40, "long": 10}
    assert [r.request_id for r in d.finished] == ["short"]
    assert shape(d.step()) == {"long": 256}
    d.add("late", 40, max_tokens=1, first_token=3100)  # arrives while the long one runs
    assert shape(d.step()) == {"late": 40, "long": 10}
    d.run()
    assert d.kv.get_num_free_blocks() == d.kv.get_max_resource_count()


def test_shortest_first_keeps_the_order_of_similar_prompts():
    """Prompts within 2x of each other keep their order and full steps: a steady flow of
    slightly shorter prompts cannot starve an earlier one."""
    d = Driver(max_num_tokens=32, chunking_policy=ChunkingPolicy.SHORTEST_FIRST, num_blocks=64)
    d.add("r0", 40, first_token=1)
    d.add("r1", 36, first_token=101)  # shorter, but not 2x shorter: behind r0
    d.add("r2", 33, first_token=201)
    assert shape(d.step()) == {"r0": 32}
    assert shape(d.step()) == {"r0": 8, "r1": 2}  # r0's last 8 are much shorter: sized for them
    assert shape(d.step()) == {"r0": 1, "r1": 31}  # r0 decodes; r1 before r2, though r2 is shorter
    d.run()


def test_max_batch_size_caps_running_requests():
    d = Driver(max_batch_size=2)
    for i in range(3):
        d.add(f"r{i}", 5, first_token=10 * i + 1)
    assert set(shape(d.step())) == {"r0", "r1"}
    while len(d.finished) < 2:
        assert "r2" not in shape(d.step())
    d.run()


def test_guaranteed_no_evict_admits_only_what_can_finish():
    # each request needs 2 blocks to completion (12 prompt + 4 new tokens); 3 blocks hold one
    d = Driver(num_blocks=3)
    d.add("a", 12, first_token=1)
    d.add("b", 12, first_token=30)
    out = d.step()
    assert shape(out) == {"a": 12}
    assert d.kv.get_num_free_blocks() == 1  # free, but reserved for a's last token
    while not d.finished:
        assert "b" not in shape(d.step())
    outs = d.run()
    assert d.sched.num_preemptions == 0
    assert not any(o.preempted_ids for o in outs)


def test_max_utilization_preempts_the_newest_when_full():
    d = Driver(num_blocks=4, capacity_policy=CapacityPolicy.MAX_UTILIZATION)
    a = d.add("a", 15, max_tokens=10, first_token=1)  # 2 blocks now, 4 to finish
    b = d.add("b", 15, max_tokens=10, first_token=30)
    assert shape(d.step()) == {"a": 15, "b": 15}  # both admitted: 4 blocks in use
    assert d.kv.get_num_free_blocks() == 0
    out = d.step()  # position 15 fits; both decode
    assert shape(out) == {"a": 1, "b": 1}
    out = d.step()  # position 16 needs a third block each: b (the newest) makes room for a
    assert out.preempted_ids == ["b"]
    assert shape(out) == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and d.sched.num_preemptions >= 1
    assert b.num_output_tokens == 2  # kept: recomputed, not resampled
    d.run()
    assert a.num_output_tokens == b.num_output_tokens == 10
    assert b.num_cached_tokens == 0  # set at first admission only


def test_static_batch_admits_nothing_while_a_batch_runs():
    d = Driver(capacity_policy=CapacityPolicy.STATIC_BATCH)
    d.add("a", 5, max_tokens=3)
    d.add("b", 5, max_tokens=6, first_token=10)
    assert set(shape(d.step())) == {"a", "b"}
    d.add("c", 5, first_token=20)
    while d.sched.running:
        assert "c" not in shape(d.step())
    assert shape(d.step()) == {"c": 5}
    d.run()


def test_prefix_hit_is_taken_at_admission():
    d = Driver()
    d.add("a", 20, first_token=1)  # 2 full blocks
    d.run()
    b = d.add("b", 27, first_token=1)  # same first 20 tokens, then more
    out = d.step()
    assert out.chunks[0].start == 16 and out.chunks[0].num_new_tokens == 11
    assert b.num_cached_tokens == 16
    d.run()


def test_a_request_that_can_never_fit_is_refused():
    d = Driver(num_blocks=4)
    with pytest.raises(CapacityError, match="KV blocks"):
        d.add("huge", 30, max_tokens=10)  # 40 tokens -> 5 blocks > 4
    d.add("ok", 30, max_tokens=2)
    d.run()


def test_max_utilization_refuses_what_could_never_finish():
    d = Driver(num_blocks=4, capacity_policy=CapacityPolicy.MAX_UTILIZATION)
    with pytest.raises(CapacityError):
        d.add("huge", 30, max_tokens=10)


def test_window_caps_what_a_request_needs():
    d = Driver(num_blocks=4, window=8)  # at most cdiv(8, 8) + 1 = 2 blocks per request
    assert d.kv.num_blocks_for_tokens(60) == 2
    a = d.add("long", 20, max_tokens=40)  # 60 tokens would be 8 blocks without the window
    b = d.add("other", 20, max_tokens=40, first_token=100)  # together: 16 blocks uncapped, 4 capped
    held = []
    while d.sched.num_unfinished:
        d.step()
        held.append(max(len(set(d.kv.blocks_of(r.request_id)) - {NULL_BLOCK_ID}) for r in (a, b)))
    assert max(held) <= 2 and a.num_output_tokens == b.num_output_tokens == 40
    assert d.sched.num_preemptions == 0  # both ran side by side in 4 blocks
    d.kv.assert_all_free()


def test_guaranteed_no_evict_reserves_what_running_requests_will_need():
    d = Driver(num_blocks=4)  # block size 8
    a = d.add("a", 8, max_tokens=16)  # grows to 24 tokens: 3 blocks by its end
    d.step()
    b = d.add("b", 8, max_tokens=8, first_token=100)  # needs 2 blocks; only 1 is not promised to a
    while not a.is_finished:
        out = d.step()
        assert "b" not in shape(out), "admitted b into blocks a was promised"
    d.run()
    assert d.sched.num_preemptions == 0 and b.num_output_tokens == 8


def test_finish_while_waiting_and_mid_prefill_frees_everything():
    d = Driver(max_num_tokens=16)
    a = d.add("a", 40)
    b = d.add("b", 10, first_token=50)
    d.step()  # a mid-prefill, b waiting
    assert d.kv.blocks_of("a") and not d.kv.blocks_of("b")
    assert d.sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert d.sched.finish(a, RequestStatus.FINISHED_ABORTED)
    assert d.sched.num_unfinished == 0
    d.kv.assert_all_free()


def test_prefill_service_default_lets_a_short_prompt_pass_a_long_one():
    """The prefill role's default scheduling (SHORTEST_FIRST, 256-token steps): a short prompt
    queued behind a 2,000-token one is prefilled first, in a step sized for it."""
    from pdserve.worker.settings import WorkerSettings

    cfg = WorkerSettings.from_settings("prefill", {}).engine_config().scheduler
    d = Driver(max_num_tokens=cfg.max_num_tokens, chunking_policy=cfg.chunking_policy,
               max_model_len=4096, num_blocks=300)
    d.add("long", 2000, max_tokens=1)
    d.add("short", 40, max_tokens=1, first_token=3000)
    first = shape(d.step())
    assert first["short"] == 40 and first["long"] <= 10
    assert [r.request_id for r in d.finished] == ["short"]
    d.run()
    assert d.kv.get_num_free_blocks() == d.kv.get_max_resource_count()


def test_a_remote_prefill_is_admitted_past_prompts_that_wait_for_budget():
    """A decode whose step budget its own prompts spent still admits a request whose prompt a
    prefill worker computes (it costs the step no tokens), so that its prefill is asked for
    now; the prompts it passed keep their order and get the next steps' budget."""
    d = Driver(max_num_tokens=20)
    d.add("a", 30)
    d.add("b", 10, first_token=100)
    r = d.add("r", 16, first_token=200, remote=True)
    out = d.step()
    assert shape(out) == {"a": 20}  # the budget, spent on the oldest prompt
    assert out.remote_ready == [r] and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [q.request_id for q in d.sched.waiting] == ["b"]
    assert shape(d.step()) == {"a": 10, "b": 10}
    # the remote prefill's blocks are filled: it decodes with the others, and all end
    r.num_computed_tokens = r.num_prompt_tokens
    d.sched.finish_remote("r")
    r.output_token_ids.append(7)
    d.kv.update_resources(r)
    d.run()
    assert sorted(q.request_id for q in d.finished) == ["a", "b", "r"]


def test_a_remote_prefill_that_does_not_fit_stops_the_scan():
    d = Driver(max_num_tokens=8, max_batch_size=2)
    d.add("a", 30)
    d.add("b", 10, first_token=100)
    d.add("r", 16, first_token=200, remote=True)
    out = d.step()
    assert shape(out) == {"a": 8} and out.remote_ready == []  # the second slot is b's: it came first
    assert [q.request_id for q in d.sched.waiting] == ["b", "r"]

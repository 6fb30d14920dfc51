"""Continuous batching: each step picks which requests compute how many tokens.

One step's token budget (`max_num_tokens`) goes first to running requests that decode (one
token each), then to running prompts still being prefilled in chunks, then to waiting
requests in arrival order. The capacity policy decides admission and what happens when
the cache is full, the chunking policy how the budget is shared among prompts: both are
objects chosen once (`engine.policies`).
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.connector import ConnectorMetadata, ConnectorRequest, KVConnectorScheduler
from pdserve.common.errors import CapacityError
from pdserve.engine.kv_cache_manager import KVCacheManager, PrefixHit
from pdserve.engine.policies import CAPACITY, CHUNKING, tokens_left
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.speculation import NO_SPECULATION, NoSpeculation


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """`request` computes tokens [start, start + num_new_tokens) this step; a decoding one
    may also check `draft_token_ids`, guesses of the tokens after it (engine.speculation)."""

    request: Request
    start: int
    num_new_tokens: int
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_rows(self) -> int:
        """Positions the step computes for this chunk: its tokens and its drafts."""
        return self.num_new_tokens + len(self.draft_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """The tokens the step feeds at its positions: its request's, then its drafts."""
        ids = self.request.token_ids(self.start, self.start + self.num_new_tokens)
        return ids + list(self.draft_token_ids) if self.draft_token_ids else ids

    @property
    def samples_token(self) -> bool:
        """True when this chunk reaches the end of the known tokens (logits are needed)."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    remote_ready: list[Request] = field(default_factory=list)  # now waiting for remote KV
    connector_meta: ConnectorMetadata = field(default_factory=ConnectorMetadata)

    @property
    def num_tokens(self) -> int:
        """Positions the step computes, drafts included."""
        return sum(c.num_rows for c in self.chunks)


def connector_view(request: Request) -> ConnectorRequest:
    return ConnectorRequest(request.request_id, tuple(request.prompt_token_ids),
                            tuple(request.block_hashes), request.transfer_params,
                            tuple(request.block_digests), request.stream_layers)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 connector: KVConnectorScheduler, max_model_len: int,
                 speculator: NoSpeculation = NO_SPECULATION, loras=None) -> None:
        """`loras`: the engine's adapters (engine.lora): a request is admitted only once a
        device slot holds its adapter, and gives the slot back when preempted or ended."""
        from pdserve.engine.lora import NO_LORAS

        self.config = config
        self.loras = loras or NO_LORAS
        self.speculator = speculator
        self.kv = kv
        self.connector = connector
        self.capacity = CAPACITY[config.capacity_policy](kv, max_model_len)
        self.chunking = CHUNKING[config.chunking_policy](config, kv.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KVS, blocks held
        self.num_preemptions = 0
        self.num_prefix_queries = 0  # prompt tokens of admitted requests (first admission)
        self.num_prefix_hits = 0  # of those, found in the prefix cache

    # -- admission control --------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue `request`; CapacityError if the cache could never hold it, even alone. Every
        policy checks the full length: under MAX_UTILIZATION a request that outgrows the
        whole cache would preempt itself and then wait forever."""
        need = self.kv.num_blocks_for_tokens(request.final_length)
        if need > self.kv.get_max_resource_count():
            raise CapacityError(f"request needs {need} KV blocks but the cache has "
                                f"{self.kv.get_max_resource_count()}: lower max_tokens or enlarge the cache")
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.remote)

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget, reserve = self.chunking.begin_step(self.waiting, self.running, self.config.max_num_tokens)
        had_running = bool(self.running) or bool(self.remote)
        budget = self._schedule_running(out, budget, reserve, lambda: self._preempt(self.running[-1], out))
        if self.capacity.admits_while_running or not had_running:
            self._schedule_waiting(out, budget)
        self.speculator.add_drafts(out.chunks, self.config.max_num_tokens)
        self.kv.offload_fence()  # blocks evicted this step are copied out before anything writes them
        now = time.monotonic()
        for chunk in out.chunks:
            if chunk.request.first_scheduled_time is None:
                chunk.request.first_scheduled_time = now
        out.connector_meta = self.connector.build_connector_meta()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, reserve: int,
                          preempt_newest: Callable[[], Request]) -> int:
        """Decodes first (a token each), then running prompts in the chunking policy's order;
        `reserve`: tokens the prompts leave to a shorter waiting one."""
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        self.chunking.order_prefills(prefills)
        for request in decodes + prefills:
            if request not in self.running:  # preempted earlier in this loop
                continue
            remaining = tokens_left(request)
            n = self.chunking.chunk(remaining, budget - reserve, len(prefills) + len(self.waiting), budget) \
                if remaining > 1 else 1
            if n > budget or n <= 0 or not self.capacity.grow(request, n, preempt_newest):
                continue
            out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, n))
            budget -= n
        return budget

    def _preempt(self, request: Request, out: SchedulerOutput) -> Request:
        """Free `request`'s blocks and queue it first, to be recomputed."""
        self.running.remove(request)
        out.chunks[:] = [c for c in out.chunks if c.request is not request]
        self.kv.free_resources(request.request_id)
        self.loras.deactivate(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted_ids.append(request.request_id)
        return request

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in arrival order while the budget lasts. A request whose
        prompt a prefill worker computes costs this step no tokens: once the budget is spent
        it is still admitted past the prompts that wait for the next step's, so that its
        prefill starts now instead of after theirs. A passed prompt keeps its slot in the
        batch (not its blocks); the first request that cannot be admitted (blocks, batch
        size) stops the scan."""
        prefilling = sum(1 for r in self.running if tokens_left(r) > 1)
        passed: list[Request] = []  # prompts left for a later step's budget, in order
        while self.waiting:
            if len(self.running) + len(self.remote) + len(passed) >= self.config.max_batch_size:
                break  # (a passed prompt keeps its place in the batch)
            request = self.waiting[0]
            if budget <= 0 and not request.waits_for_remote_prefill:
                passed.append(self.waiting.popleft())
                continue
            if not self._admit(request, out, budget, prefilling + len(self.waiting) + len(passed)):
                break
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.remote[request.request_id] = request
                out.remote_ready.append(request)
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            budget -= out.chunks[-1].num_new_tokens
        self.waiting.extendleft(reversed(passed))

    def _admit(self, request: Request, out: SchedulerOutput, budget: int, num_prefilling: int) -> bool:
        """Admit `request` if a slot holds its adapter and its blocks fit (`_admit_blocks`)."""
        if not self.loras.try_activate(request):
            return False
        if self._admit_blocks(request, out, budget, num_prefilling):
            return True
        self.loras.deactivate(request)
        return False

    def _admit_blocks(self, request: Request, out: SchedulerOutput, budget: int,
                      num_prefilling: int) -> bool:
        # a prompt whose logprobs are wanted runs whole: neither the cache nor a load serves it
        whole = request.needs_prompt_logprobs
        hit = PrefixHit(()) if whole else self.kv.find_prefix_hit(request)
        hit_tokens = hit.num_blocks * self.kv.block_size
        creq = connector_view(request)
        num_external = self.connector.get_num_new_matched_tokens(creq, hit_tokens)  # it learns of the request
        if whole:
            num_external = 0
        wants_remote = request.waits_for_remote_prefill
        if not self.capacity.has_room(request, hit, itertools.chain(self.running, self.remote.values())):
            return False
        computed = hit_tokens + num_external
        remaining = request.num_tokens - computed
        if wants_remote:
            n = request.num_prompt_tokens - hit_tokens  # the whole uncached prompt arrives
        else:
            n = self.chunking.chunk(remaining, budget, num_prefilling, budget)
            if n == 0 and remaining:  # a prompt that runs whole: alone in the step, over budget
                if out.chunks:
                    return False
                n = remaining
        if not self.kv.try_take_prefix_hit(request, hit, n if wants_remote else num_external + n):
            return False
        if request.num_cached_tokens < 0:  # its first admission
            request.num_cached_tokens = hit_tokens
            tiers = self.connector.matched_tokens_by_tier(request.request_id) if num_external else {}
            request.cached_tokens_by_tier = {k: v for k, v in (("device", hit_tokens), *tiers.items()) if v}
            self.num_prefix_queries += request.num_prompt_tokens
            self.num_prefix_hits += hit_tokens
        self.connector.update_state_after_alloc(creq, self.kv.blocks_of(request.request_id), num_external)
        if num_external:
            request.num_external_tokens = request.num_loaded_tokens = num_external
        request.num_computed_tokens = computed
        if wants_remote:  # loads land before the step ends; the prefill fills the rest
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        else:
            out.chunks.append(ScheduledChunk(request, computed, n))
        return True

    # -- remote prefill (decode side of a disaggregated request) ------------------------
    def finish_remote(self, request_id: str) -> Request | None:
        """The remote prefill filled this request's blocks: it decodes from now on."""
        request = self.remote.pop(request_id, None)
        if request is not None:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        return request

    def recompute_remote(self, request_id: str) -> Request | None:
        """The remote prefill failed: compute the prompt here, in the blocks already held."""
        request = self.finish_remote(request_id)
        if request is not None:
            request.remote_prefill = False
        return request

    # -- endings ------------------------------------------------------------------------
    def find(self, request_id: str) -> Request | None:
        everyone = itertools.chain(self.running, self.remote.values(), self.waiting)
        return next((r for r in everyone if r.request_id == request_id), None)

    def finish(self, request: Request, status: RequestStatus) -> bool:
        """End `request`. Returns True if its blocks were freed now (False: the connector
        still sends from them; free them when it reports the send done)."""
        request.status = status
        self.loras.deactivate(request)
        if request in self.running:
            self.running.remove(request)
        elif request.request_id in self.remote:
            del self.remote[request.request_id]
        elif request in self.waiting:
            self.waiting.remove(request)
        keep = self.connector.request_finished(connector_view(request), self.kv.blocks_of(request.request_id))
        if not keep:
            self.kv.free_resources(request.request_id)
        return not keep

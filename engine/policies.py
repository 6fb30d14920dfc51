"""The scheduler's policies as objects, chosen once from its config (`capacity_policy`,
`chunking_policy`): the scheduler calls them at fixed points of a step and never branches on
a policy's name.

Capacity (`Capacity`) decides admission and what a running request does when the cache is
full:

* GUARANTEED_NO_EVICT: admit only if the free blocks cover every running request's blocks
  to completion plus the new one's; nothing is ever preempted.
* MAX_UTILIZATION: admit whatever fits now; when a running request cannot grow, preempt the
  most recently admitted one (its blocks are freed, it is recomputed later).
* STATIC_BATCH: admit a batch only when nothing runs; run it to its end.

Chunking (`Chunking`) decides how a step's token budget is shared among prompts:

* FIRST_COME_FIRST_SERVED: the oldest prompt first, each as large a chunk as the budget allows.
* EQUAL_PROGRESS: the budget shared evenly among the prompts in flight (at least a block each).
* SHORTEST_FIRST: a prompt goes ahead of those with at least twice its tokens left, in a
  step sized for it (`ShortestFirst.begin_step`).
"""
from __future__ import annotations

import math
from collections import deque
from typing import Callable, Iterable

from pdserve.engine.config import CapacityPolicy, ChunkingPolicy, SchedulerConfig
from pdserve.engine.kv_cache_manager import KVCacheManager, PrefixHit
from pdserve.engine.request import Request

UNCAPPED = 1 << 30  # a chunk cap that never binds (chunked prefill off)

# SHORTEST_FIRST: a step that carries the shortest prompt left holds at most this many times
# its tokens (`pdserve bench mixed-prefill`: a 40-token chat behind a 2,000-token prompt)
SHORTEST_FIRST_STEP = 1.25


# -- capacity ------------------------------------------------------------------------------
class Capacity:
    """Admission and growth under one capacity policy. Contract: `has_room` is asked before
    a waiting request takes any block (False: it waits, and the scan of the queue stops);
    `grow` gets a running request its blocks for the step, or says it sits this step out;
    `admits_while_running` False keeps the queue shut while any request runs or waits for
    a remote prefill."""

    admits_while_running = True

    def __init__(self, kv: KVCacheManager, max_model_len: int) -> None:
        self.kv = kv
        self.max_model_len = max_model_len

    def has_room(self, request: Request, hit: PrefixHit, holders: Iterable[Request]) -> bool:
        """The free blocks, once `hit` is taken, cover `request` to its final length and
        every request in `holders` (running or receiving) to theirs."""
        needed = self.kv.num_blocks_for_tokens(request.final_length) - hit.num_blocks
        free = self.kv.num_free_blocks_after_taking(hit)
        reserved = sum(self.kv.get_needed_resource_to_completion(r, self.max_model_len) for r in holders)
        return free - reserved >= needed

    def grow(self, request: Request, num_new_tokens: int, preempt_newest: Callable[[], Request]) -> bool:
        """Blocks for `num_new_tokens` more tokens of running `request`; False: not now.
        Admission reserved room, so only a racing free fails here; nothing is preempted."""
        return self.kv.prepare_resources(request, num_new_tokens)


class GuaranteedNoEvict(Capacity):
    pass


class MaxUtilization(Capacity):
    def has_room(self, request: Request, hit: PrefixHit, holders: Iterable[Request]) -> bool:
        return True  # the allocation decides; a full cache preempts later

    def grow(self, request: Request, num_new_tokens: int, preempt_newest: Callable[[], Request]) -> bool:
        """Preempts the newest running request until the blocks fit; when that is `request`
        itself, it sits this step out."""
        while not self.kv.prepare_resources(request, num_new_tokens):
            if preempt_newest() is request:
                return False
        return True


class StaticBatch(Capacity):
    admits_while_running = False


CAPACITY: dict[CapacityPolicy, type[Capacity]] = {
    CapacityPolicy.GUARANTEED_NO_EVICT: GuaranteedNoEvict,
    CapacityPolicy.MAX_UTILIZATION: MaxUtilization,
    CapacityPolicy.STATIC_BATCH: StaticBatch,
}


# -- chunking ------------------------------------------------------------------------------
def tokens_left(request: Request) -> int:
    return request.num_tokens - request.num_computed_tokens


class Chunking:
    """How a step's budget goes to prompts (FIRST_COME_FIRST_SERVED as the base). Contract:
    `begin_step` runs first in every step and returns (the step's budget, tokens running
    prompts leave to a shorter waiting one); `order_prefills` orders the running prompts in
    place before they take the budget; `chunk_cap` bounds one prompt's chunk."""

    def __init__(self, config: SchedulerConfig, block_size: int) -> None:
        self.chunked = config.enable_chunked_prefill
        self.block_size = block_size

    def begin_step(self, waiting: deque[Request], running: list[Request], budget: int) -> tuple[int, int]:
        return budget, 0

    def order_prefills(self, prefills: list[Request]) -> None:
        pass

    def chunk_cap(self, num_prefilling: int, budget: int) -> int:
        return budget if self.chunked else UNCAPPED

    def chunk(self, remaining: int, room: int, num_prefilling: int, budget: int) -> int:
        """Tokens a prompt with `remaining` left computes in a step that leaves it `room` of
        `budget`; 0 when it cannot run (no room, or too little for a prompt that runs whole)."""
        n = min(remaining, room, self.chunk_cap(num_prefilling, budget))
        return n if n == remaining or self.chunked else 0


class FirstComeFirstServed(Chunking):
    pass


class EqualProgress(Chunking):
    def chunk_cap(self, num_prefilling: int, budget: int) -> int:
        if not self.chunked:
            return UNCAPPED
        return max(self.block_size, budget // num_prefilling) if num_prefilling > 1 else budget


def _rank(request: Request) -> int:
    return tokens_left(request).bit_length()


class ShortestFirst(Chunking):
    def order_prefills(self, prefills: list[Request]) -> None:
        prefills.sort(key=_rank)

    def begin_step(self, waiting: deque[Request], running: list[Request], budget: int) -> tuple[int, int]:
        """A prompt goes ahead of those with at least twice its tokens left (prompts are
        ranked by the power of two of their remaining tokens; within a rank, first come first
        served, so a steady flow of similar prompts cannot starve one), and while prompts of
        different ranks wait, a step holds at most 1.25x the shortest one's tokens: a
        40-token prompt behind a 2,000-token one runs in a 50-token step, not a 256-token
        one. Running prompts leave a shorter waiting one room (the reserve)."""
        local = [r for r in waiting if not r.waits_for_remote_prefill]
        if len(local) > 1:
            order = sorted(waiting, key=_rank)  # stable: FIFO within a rank
            waiting.clear()
            waiting.extend(order)
        prefilling = [r for r in running if tokens_left(r) > 1]
        candidates = prefilling + local
        if len({_rank(r) for r in candidates}) < 2:
            return budget, 0  # nothing much shorter than the rest: plain steps
        top = min(_rank(r) for r in candidates)
        shortest = min(tokens_left(r) for r in candidates if _rank(r) == top)
        reserve = 0
        if any(_rank(r) == top for r in local) and all(_rank(r) > top for r in prefilling):
            reserve = shortest  # the shortest is still waiting: running prompts leave it room
        num_decodes = sum(1 for r in running if tokens_left(r) == 1)
        return min(budget, num_decodes + max(self.block_size, math.ceil(SHORTEST_FIRST_STEP * shortest))), reserve


CHUNKING: dict[ChunkingPolicy, type[Chunking]] = {
    ChunkingPolicy.FIRST_COME_FIRST_SERVED: FirstComeFirstServed,
    ChunkingPolicy.EQUAL_PROGRESS: EqualProgress,
    ChunkingPolicy.SHORTEST_FIRST: ShortestFirst,
}

"""Routing policies: pick one worker of a pool and say why.

Each pool (prefill, decode) has its own policy object, made by name with `make_policy`.
"""
from __future__ import annotations

import abc
import random
from dataclasses import dataclass
from typing import ClassVar, Sequence

from pdserve.common.block_hash import stable_hash64
from pdserve.router.kv_index import TIER_RANK
from pdserve.router.adapters import holds, serves
from pdserve.router.worker_registry import WorkerRecord


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """What a policy may look at: the prompt's block hashes, its length, the session key."""

    block_hashes: tuple[int, ...] = ()
    session_key: str = ""  # empty: no session
    num_prompt_tokens: int = 0  # 0: as many as the full blocks hold
    block_size: int = 16

    @property
    def prompt_tokens(self) -> int:
        return self.num_prompt_tokens or len(self.block_hashes) * self.block_size


@dataclass(frozen=True, slots=True)
class Pick:
    record: WorkerRecord
    reason: str  # short, metric-label friendly ("prefix_match", "round_robin", ...)


class RoutingPolicy(abc.ABC):
    """Contract: `choose` gets a non-empty candidate list sorted by worker id (alive,
    non-suspect workers of one pool and model) and returns one of them with a reason.
    It must not block or raise. A policy may keep state (a counter) across calls."""

    name: ClassVar[str]

    @abc.abstractmethod
    def choose(self, candidates: Sequence[WorkerRecord], query: RouteQuery) -> Pick: ...


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[WorkerRecord], query: RouteQuery) -> Pick:
        record = candidates[self._next % len(candidates)]
        self._next += 1
        return Pick(record, "round_robin")


class LeastLoaded(RoutingPolicy):
    """Lowest load score (queued + running + sent since the last report); ties rotate."""

    name = "least_loaded"

    def __init__(self) -> None:
        self._ties = RoundRobin()

    def pick(self, candidates: Sequence[WorkerRecord], query: RouteQuery) -> WorkerRecord:
        lowest = min(r.load_score() for r in candidates)
        return self._ties.choose([r for r in candidates if r.load_score() == lowest], query).record

    def choose(self, candidates: Sequence[WorkerRecord], query: RouteQuery) -> Pick:
        return Pick(self.pick(candidates, query), "least_loaded")


# What a prompt block found in each tier is worth, in blocks found on the device: a hit below
# the pool costs an onboard before the forward, and the further down, the more it costs.
TIER_WEIGHT = {"device": 1.0, "host": 0.75, "disk": 0.5, "redis": 0.5}


class PrefixAware(RoutingPolicy):
    """Cache affinity where it pays and while the pool stays balanced.

    A worker's score is the run of the prompt's leading blocks it holds (its KV events say
    where: router.kv_index), each block weighed by its nearest tier (TIER_WEIGHT: device over
    host over disk/Redis). Among the workers at most `max_load_gap` requests above the least
    loaded, the best score wins when its run is worth keeping (at least `min_match_blocks`
    blocks and `min_match_fraction` of the prompt: a shared chat-template prefix is not); ties
    go to the less loaded. Otherwise the least loaded wins (ties rotate), with the reason. The
    reason of a match names the slowest tier its run reaches ("prefix_match": all on device).
    """

    name = "prefix_aware"

    def __init__(self, min_match_blocks: int = 2, min_match_fraction: float = 0.5,
                 max_load_gap: int = 4) -> None:
        self._least_loaded = LeastLoaded()
        self.min_match_blocks = min_match_blocks
        self.min_match_fraction = min_match_fraction
        self.max_load_gap = max_load_gap

    def _worth_keeping(self, run: Sequence[str], query: RouteQuery) -> bool:
        return len(run) >= self.min_match_blocks and len(run) * query.block_size >= \
            self.min_match_fraction * query.prompt_tokens

    def choose(self, candidates: Sequence[WorkerRecord], query: RouteQuery) -> Pick:
        runs = {r.worker_id: r.kv.leading_tiers(query.block_hashes) for r in candidates}
        if not any(runs.values()):
            return Pick(self._least_loaded.pick(candidates, query), "no_prefix_match")
        if not any(self._worth_keeping(run, query) for run in runs.values()):
            return Pick(self._least_loaded.pick(candidates, query), "short_prefix_match")
        lowest = min(r.load_score() for r in candidates)
        eligible = [r for r in candidates if r.load_score() - lowest <= self.max_load_gap
                    and self._worth_keeping(runs[r.worker_id], query)]
        if not eligible:
            return Pick(self._least_loaded.pick(candidates, query), "load_imbalance")
        score = {r.worker_id: sum(TIER_WEIGHT[t] for t in runs[r.worker_id]) for r in eligible}
        top = max(score.values())
        record = self._least_loaded.pick([r for r in eligible if score[r.worker_id] == top], query)
        slowest = max(runs[record.worker_id], key=TIER_RANK.__getitem__)
        return Pick(record, "prefix_match" if slowest == "device" else f"prefix_match_{slowest}")


class SessionAffinity(RoutingPolicy):
    """Rendezvous (highest random weight) hashing of the session key over the candidates:
    a session stays on its worker while that worker lives, and losing a worker moves only
    its own sessions. No session key: least loaded."""

    name = "session_affinity"

    def __init__(self) -> None:
        self._least_loaded = LeastLoaded()

    def choose(self, candidates: Sequence[WorkerRecord], query: RouteQuery) -> Pick:
        if not query.session_key:
            return Pick(self._least_loaded.pick(candidates, query), "no_session")
        record = max(candidates, key=lambda r: (stable_hash64("session", query.session_key, r.worker_id),
                                                r.worker_id))
        return Pick(record, "session_hash")


class PowerOfTwo(RoutingPolicy):
    """Power of two choices: two different candidates drawn at random, the less loaded one
    wins (a tie: the first drawn). Load-aware at the cost of two lookups, and no herd: routers
    whose load views lag do not all pile onto the one least loaded worker."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[WorkerRecord], query: RouteQuery) -> Pick:
        if len(candidates) == 1:
            return Pick(candidates[0], "only_worker")
        first, second = self._rng.sample(range(len(candidates)), 2)
        a, b = candidates[first], candidates[second]
        return Pick(b if b.load_score() < a.load_score() else a, "power_of_two")


def adapter_candidates(candidates: Sequence[WorkerRecord], lora_name: str,
                       max_load_gap: int = 4) -> tuple[list[WorkerRecord], str]:
    """The candidates a request under LoRA adapter `lora_name` goes to, and why: only workers
    that may serve it, and of those the ones holding it loaded (no load on the request's path)
    while the least loaded holder is at most `max_load_gap` requests above the least loaded
    of all; past that, load wins and the chosen worker loads the adapter. No adapter: all."""
    if not lora_name:
        return list(candidates), ""
    serving = [r for r in candidates if serves(r, lora_name)]
    holding = [r for r in serving if holds(r, lora_name)]
    if not holding:
        return serving, "lora_load"
    if min(r.load_score() for r in holding) - min(r.load_score() for r in serving) > max_load_gap:
        return serving, "lora_load_imbalance"
    return holding, "lora_holder"


POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (RoundRobin, LeastLoaded, PrefixAware, SessionAffinity, PowerOfTwo)
}


def make_policy(name: str) -> RoutingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r} ({', '.join(POLICIES)})") from None

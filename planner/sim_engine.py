"""One simulated engine: the rules of `engine/scheduler.py` over token counts, in simulated time.

Each step, as the engine's `Scheduler.schedule` does: the token budget (`max_num_tokens`) goes
first to running requests that decode (one position each), then to running prompts still being
prefilled in chunks (FIRST_COME_FIRST_SERVED: the oldest takes what is left; EQUAL_PROGRESS: an
equal share each; SHORTEST_FIRST: shorter prompts first, in a step of at most 1.25x the
shortest), then to waiting requests in arrival order while the batch (`max_batch_size`) and the
cache allow. GUARANTEED_NO_EVICT admits only what fits to completion beside every admitted
request's own completion; MAX_UTILIZATION admits what fits now and preempts the newest running
request (recomputed later) when one cannot grow. A request whose prompt a prefill worker
computes costs its decode no step tokens: it holds its prompt's blocks from admission and waits
for the KV (`finish_remote`). The step lasts what the profile's `step_seconds` says for its work,
times the share of the host's cores it gets (`Host`).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import simpy

from pdserve.planner.profile import Profile

SHORTEST_FIRST_STEP = 1.25  # the engine's scheduler.SHORTEST_FIRST_STEP


@dataclass(frozen=True, slots=True)
class EngineKnobs:
    """The engine settings a candidate varies (the workers' flags of the same names)."""

    max_num_tokens: int = 2048
    max_batch_size: int = 64
    capacity_policy: str = "GUARANTEED_NO_EVICT"
    chunking_policy: str = "FIRST_COME_FIRST_SERVED"
    enable_chunked_prefill: bool = True


class SimRequest:
    """One request's progress; a disaggregated one has a twin on its prefill worker."""

    __slots__ = ("rid", "arrival_s", "input_len", "output_len", "cached_len", "computed", "generated",
                 "first_token_s", "finish_s", "remote", "forward_s", "transfer_s", "gain", "prefill_only",
                 "twin")

    def __init__(self, rid: int, arrival_s: float, input_len: int, output_len: int, cached_len: int = 0,
                 prefill_only: bool = False) -> None:
        self.rid, self.arrival_s = rid, arrival_s
        self.input_len, self.output_len, self.cached_len = input_len, output_len, cached_len
        self.computed = 0  # tokens whose KV exists (prompt, then generated)
        self.generated = 0
        self.first_token_s = math.nan
        self.finish_s = math.nan
        self.remote = False  # its prompt is computed by a prefill worker
        self.forward_s = 0.0  # prefill worker: time of the steps that computed this prompt
        self.transfer_s = 0.0
        self.gain = 0.0  # speculation: fractional tokens carried to the next step
        self.prefill_only = prefill_only
        self.twin: SimRequest | None = None

    @property
    def prompt_left(self) -> int:
        return max(0, self.input_len - self.computed)

    @property
    def final_len(self) -> int:
        return self.input_len + (1 if self.prefill_only else self.output_len)


class Host:
    """Cores that workers share: a step on a host where k workers are busy takes
    max(1, k * threads / cores) times its profiled time, k counted as the step starts and
    held for the whole step, as an engine under `pdserve up` drops to its base thread count
    when a peer computes (worker/core_share.py) (None cores: each worker has its own)."""

    def __init__(self, cores: int | None, threads: int) -> None:
        self.cores, self.threads, self.busy = cores, threads, 0

    def factor(self) -> float:
        if not self.cores:
            return 1.0
        return max(1.0, self.busy * self.threads / self.cores)


class Listener(Protocol):
    """What the fleet hears from an engine, at the simulated time it happens."""

    def token(self, engine: "SimEngine", request: SimRequest) -> None: ...

    def prompt_done(self, engine: "SimEngine", request: SimRequest) -> None:
        """A prefill worker computed `request`'s prompt (its KV goes to the decode now)."""

    def remote_admitted(self, engine: "SimEngine", request: SimRequest) -> None:
        """A decode admitted `request` for a remote prefill (its blocks are held)."""


class SimEngine:
    """A worker's engine loop: steps while it has work, sleeps until it gets some."""

    def __init__(self, env: simpy.Environment, name: str, profile: Profile, knobs: EngineKnobs, host: Host,
                 listener: Listener) -> None:
        self.env, self.name, self.profile, self.knobs, self.host = env, name, profile, knobs, host
        self.listener = listener
        self.block_size = profile.block_size
        self.num_blocks = profile.kv_tokens // profile.block_size
        self.used = 0  # blocks held
        self.held: dict[int, int] = {}  # rid -> blocks held
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.remote: dict[int, SimRequest] = {}
        self.busy_s = 0.0
        self.num_steps = 0
        self._wake = env.event()
        self._stepping = False
        self._between: list = []  # what waits for the running step to end (`between_steps`)
        env.process(self._loop())

    # -- the router's view ------------------------------------------------------------------
    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.remote)

    @property
    def queued_prompt_tokens(self) -> int:
        return sum(r.prompt_left for r in self.waiting if not r.remote) + sum(
            r.prompt_left for r in self.running if r.prompt_left > 1)

    @property
    def num_decoding(self) -> int:
        return sum(1 for r in self.running if r.prompt_left == 0)

    # -- requests in ------------------------------------------------------------------------
    def add(self, request: SimRequest) -> None:
        self.waiting.append(request)
        self.wake()

    def finish_remote(self, request: SimRequest) -> None:
        """The prefill worker's KV landed: the request decodes from its second token on."""
        del self.remote[request.rid]
        request.computed = request.input_len
        self.running.append(request)
        self.wake()

    def between_steps(self, call) -> None:
        """Run `call` now if no step is running, else as the running step ends, before the next
        is planned: the engine's loop takes work from other threads between its steps."""
        if self._stepping:
            self._between.append(call)
        else:
            call()

    def wake(self) -> None:
        if not self._wake.triggered:
            self._wake.succeed()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self):
        while True:
            chunks = self._schedule()
            if not chunks:
                self._wake = self.env.event()
                yield self._wake
                continue
            self.host.busy += 1
            seconds = self._step_seconds(chunks) * self.host.factor()
            self._stepping = True
            yield self.env.timeout(seconds)
            self._stepping = False
            self.host.busy -= 1
            self.busy_s += seconds
            self.num_steps += 1
            self._apply(chunks, seconds)
            between, self._between = self._between, []
            for call in between:
                call()

    def _step_seconds(self, chunks: list[tuple[SimRequest, int, int]]) -> float:
        prefill = attention = decodes = context = 0
        for request, start, n in chunks:
            if start >= request.input_len:  # a decoding position
                decodes += 1
                context += start
            else:
                prefill += n
                attention += n * (start + n / 2)
        return self.profile.step_seconds(prefill, attention, decodes, context)

    def _apply(self, chunks: list[tuple[SimRequest, int, int]], seconds: float) -> None:
        for request, start, n in chunks:
            if start < request.input_len:
                request.forward_s += seconds
            request.computed = start + n
            if request.computed < request.input_len:
                continue
            if start < request.input_len and request.prefill_only:
                self.running.remove(request)  # done; its blocks stay held until its KV is sent
                self.listener.prompt_done(self, request)
                continue
            gain = 1.0 if start < request.input_len else self.profile.spec_tokens_per_step
            request.gain += gain
            whole = int(request.gain)
            request.gain -= whole
            request.generated = min(request.output_len, request.generated + whole)
            request.computed = request.input_len + request.generated - 1
            self.listener.token(self, request)
            if request.generated >= request.output_len:
                self.release(request)

    def release(self, request: SimRequest) -> None:
        if request in self.running:
            self.running.remove(request)
        self.used -= self.held.pop(request.rid, 0)
        self.wake()

    # -- one step's plan (engine/scheduler.py's rules) ----------------------------------------
    def _schedule(self) -> list[tuple[SimRequest, int, int]]:
        budget = self.knobs.max_num_tokens
        reserve = 0
        if self.knobs.chunking_policy == "SHORTEST_FIRST":
            budget, reserve = self._shortest_first(budget)
        chunks: list[tuple[SimRequest, int, int]] = []
        decodes = [r for r in self.running if r.prompt_left == 0]
        prefills = [r for r in self.running if r.prompt_left > 0]
        if self.knobs.chunking_policy == "SHORTEST_FIRST":
            prefills.sort(key=lambda r: r.prompt_left.bit_length())
        for request in decodes + prefills:
            if request not in self.running:
                continue
            remaining = request.prompt_left
            if remaining:
                n = min(remaining, budget - reserve, self._chunk_cap(len(prefills) + len(self.waiting), budget))
                if n <= 0 or (n < remaining and not self.knobs.enable_chunked_prefill):
                    continue
            else:
                n = 1
            if n > budget or not self._grow(request, request.computed + n, chunks):
                continue
            chunks.append((request, request.computed, n))
            budget -= n
        had_running = bool(self.running or self.remote)
        if not (self.knobs.capacity_policy == "STATIC_BATCH" and had_running):
            self._admit_waiting(chunks, budget, len(prefills))
        return chunks

    def _shortest_first(self, budget: int) -> tuple[int, int]:
        local = [r for r in self.waiting if not r.remote]
        if len(local) > 1:
            order = sorted(self.waiting, key=lambda r: r.prompt_left.bit_length())
            self.waiting.clear()
            self.waiting.extend(order)
        prefilling = [r for r in self.running if r.prompt_left > 1]
        candidates = prefilling + local
        if len({r.prompt_left.bit_length() for r in candidates}) < 2:
            return budget, 0
        top = min(r.prompt_left.bit_length() for r in candidates)
        shortest = min(r.prompt_left for r in candidates if r.prompt_left.bit_length() == top)
        reserve = 0
        if any(r.prompt_left.bit_length() == top for r in local) and all(
                r.prompt_left.bit_length() > top for r in prefilling):
            reserve = shortest
        num_decodes = sum(1 for r in self.running if r.prompt_left == 0)
        return min(budget, num_decodes + max(self.block_size, math.ceil(SHORTEST_FIRST_STEP * shortest))), reserve

    def _chunk_cap(self, num_prefilling: int, budget: int) -> int:
        if not self.knobs.enable_chunked_prefill:
            return 1 << 30
        if self.knobs.chunking_policy == "EQUAL_PROGRESS" and num_prefilling > 1:
            return max(self.block_size, budget // num_prefilling)
        return budget

    def _grow(self, request: SimRequest, num_tokens: int, chunks: list) -> bool:
        """Blocks for `num_tokens` of a running request; MAX_UTILIZATION preempts the newest."""
        while True:
            need = self.blocks_for(num_tokens) - self.held.get(request.rid, 0)
            if need <= self.num_blocks - self.used:
                self.held[request.rid] = self.held.get(request.rid, 0) + max(0, need)
                self.used += max(0, need)
                return True
            if self.knobs.capacity_policy != "MAX_UTILIZATION":
                return False
            victim = self.running[-1]
            self.release(victim)
            chunks[:] = [c for c in chunks if c[0] is not victim]
            victim.computed, victim.generated, victim.gain = 0, 0, 0.0
            self.waiting.appendleft(victim)
            if victim is request:
                return False

    def _admit_waiting(self, chunks: list, budget: int, num_prefilling: int) -> None:
        passed: list[SimRequest] = []
        while self.waiting:
            if len(self.running) + len(self.remote) + len(passed) >= self.knobs.max_batch_size:
                break
            request = self.waiting[0]
            if budget <= 0 and not request.remote:
                passed.append(self.waiting.popleft())
                continue
            n = self._admit(request, budget, num_prefilling + len(self.waiting) + len(passed), bool(chunks))
            if n is None:
                break
            self.waiting.popleft()
            if request.remote:
                self.remote[request.rid] = request
                self.listener.remote_admitted(self, request)
                continue
            self.running.append(request)
            chunks.append((request, request.computed, n))
            budget -= n
        self.waiting.extendleft(reversed(passed))

    def _admit(self, request: SimRequest, budget: int, num_prefilling: int, has_chunks: bool) -> int | None:
        """Tokens the admitted request computes this step (None: it does not fit)."""
        cached = request.cached_len if request.generated == 0 else 0
        free = self.num_blocks - self.used
        if self.knobs.capacity_policy != "MAX_UTILIZATION":
            reserved = sum(self.blocks_for(r.final_len) - self.held.get(r.rid, 0)
                           for r in (*self.running, *self.remote.values()))
            if free - reserved < self.blocks_for(request.final_len):
                return None
        if request.remote:
            n = request.input_len - cached
            hold = request.input_len
        else:
            remaining = request.input_len + max(0, request.generated - 1) - cached
            n = min(remaining, budget, self._chunk_cap(num_prefilling, budget))
            if n < remaining and not self.knobs.enable_chunked_prefill:
                if has_chunks:
                    return None
                n = remaining
            hold = cached + n
        if self.blocks_for(hold) > free:
            return None
        self.held[request.rid] = self.blocks_for(hold)
        self.used += self.held[request.rid]
        request.computed = cached
        return n

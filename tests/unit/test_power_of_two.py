"""The power_of_two routing policy: two random live workers, the less loaded wins; against a
real registry whose load counts what the router sent, and through the route planner."""
from __future__ import annotations

import collections
import random

from pdserve.router.config import POLICY_NAMES, Role, RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.planner import RoutePlanner
from pdserve.router.policies import PowerOfTwo, RouteQuery, make_policy
from pdserve.router.worker_registry import Load, Worker, WorkerRegistry
from support import FakeClock


def _registry(loads: dict[str, Load], role: Role = Role.DECODE) -> WorkerRegistry:
    registry = WorkerRegistry(worker_timeout_s=5.0, clock=FakeClock())
    for worker_id, load in loads.items():
        registry.register(Worker(worker_id, role, f"{worker_id}.local:1", "m", block_size=4), load)
    return registry


def _within_40_60_of_even(counts: collections.Counter, num_workers: int, total: int) -> bool:
    even = total / num_workers  # 40/60 of two workers' even split: every share within 20 % of even
    return len(counts) == num_workers and all(0.8 * even <= n <= 1.2 * even for n in counts.values())


def test_power_of_two_spreads_40_requests_over_3_decodes_within_40_60_of_even():
    for seed in range(20):
        registry = _registry({name: Load() for name in ("d0", "d1", "d2")})
        policy = PowerOfTwo(random.Random(seed))
        counts: collections.Counter = collections.Counter()
        for _ in range(40):  # nothing finishes: each routed request adds to its worker's load
            choice = policy.choose(registry.routable(Role.DECODE, "m"), RouteQuery())
            registry.note_routed(choice.record.worker_id)
            counts[choice.record.worker_id] += 1
            assert choice.reason == "power_of_two"
        assert _within_40_60_of_even(counts, 3, 40), (seed, counts)


def test_the_less_loaded_of_the_two_drawn_wins_and_a_lone_worker_is_taken():
    registry = _registry({"busy": Load(num_running=9), "idle": Load(), "mid": Load(num_queued=3)})
    policy = make_policy("power_of_two")
    picks = collections.Counter(policy.choose(registry.routable(Role.DECODE, "m"), RouteQuery()).record.worker_id
                                for _ in range(300))
    assert picks["busy"] == 0  # whichever pair is drawn, the busiest loses
    assert picks["idle"] > picks["mid"] > 0  # mid wins only when drawn with busy
    lone = _registry({"only": Load(num_running=50)})
    choice = policy.choose(lone.routable(Role.DECODE, "m"), RouteQuery())
    assert (choice.record.worker_id, choice.reason) == ("only", "only_worker")


def test_the_planner_routes_decode_and_prefill_by_power_of_two():
    registry = _registry({f"d{i}": Load() for i in range(3)})
    for i in range(2):
        registry.register(Worker(f"p{i}", Role.PREFILL, f"p{i}.local:1", "m", block_size=4), Load())
    # every prompt to a prefill worker (no TTFT prediction): the policies' choices are the test
    planner = RoutePlanner(registry, make_policy("power_of_two"), make_policy("power_of_two"), 0, 8, RouterMetrics(),
                           predict=False)
    decodes: collections.Counter = collections.Counter()
    prefills: collections.Counter = collections.Counter()
    for i in range(40):
        plan = planner.plan(f"r{i}", "m", 40, 4, [1000 * i + k for k in range(10)], "")
        decodes[plan.decode.worker_id] += 1
        prefills[plan.prefill.worker_id] += 1
        assert plan.decode_reason == "power_of_two" and plan.prefill_reason == "power_of_two"
    assert _within_40_60_of_even(decodes, 3, 40), decodes
    assert _within_40_60_of_even(prefills, 2, 40), prefills


def test_power_of_two_is_a_router_setting():
    assert "power_of_two" in POLICY_NAMES
    config = RouterConfig.from_settings({"decode_policy": "power_of_two", "prefill_policy": "power_of_two"})
    assert (config.decode_policy, config.prefill_policy) == ("power_of_two", "power_of_two")

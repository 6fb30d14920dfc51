"""Worker registry (liveness with a fake clock), routing policies and the route planner."""
from __future__ import annotations

import dataclasses

import pytest

from pdserve.common.errors import EXPECTED_ERRORS, ErrorKind
from pdserve.router.config import Role
from pdserve.router.link_probes import LinkProbes
from pdserve.router.metrics import RouterMetrics
from pdserve.router.planner import RoutePlanner
from pdserve.router.policies import RouteQuery, make_policy
from pdserve.router.worker_registry import ROUTED_SETTLE_S, KVBackendState, Load, Worker, WorkerRegistry
from support import FakeClock

from pdserve.proto.pdserve.v1 import kv_events_pb2


def hold(registry: WorkerRegistry, worker_id: str, block_hashes, tier: str = "device") -> None:
    """`worker_id`'s index learns, as from a snapshot, that `tier` holds `block_hashes`."""
    index = registry.get(worker_id).kv
    index.begin_sync()
    assert index.finish_sync(kv_events_pb2.KVSnapshotResponse(
        incarnation=1, last_seq=0, tiers=[kv_events_pb2.KVTierBlocks(tier=tier, block_hashes=block_hashes)]))


def worker(worker_id: str, role: Role = Role.DECODE, model: str = "m") -> Worker:
    return Worker(worker_id, role, f"{worker_id}.local:1", model, compatibility_hash=7, block_size=4)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def registry(clock):
    return WorkerRegistry(worker_timeout_s=5.0, clock=clock)


def test_liveness_suspicion_and_forgetting(registry, clock):
    registry.register(worker("a"), Load())
    registry.register(worker("b"), Load())
    assert [r.worker_id for r in registry.routable(Role.DECODE, "m")] == ["a", "b"]
    assert registry.routable(Role.DECODE, "other") == [] and registry.routable(Role.PREFILL, "m") == []
    registry.mark_suspect("a", "connection refused")
    assert [r.worker_id for r in registry.routable(Role.DECODE, "m")] == ["b"]
    assert registry.heartbeat("a", Load())  # a heartbeat clears suspicion
    clock.now += 4.0
    registry.heartbeat("a", Load())
    clock.now += 2.0  # b silent for 6 s > 5 s: dead, not routed
    assert [r.worker_id for r in registry.routable(Role.DECODE, "m")] == ["a"]
    clock.now += 10.0  # b silent for 3 timeouts: forgotten; its heartbeat must re-register
    assert not registry.heartbeat("b", Load())
    assert registry.get("b") is None
    assert registry.deregister("a") and not registry.deregister("a")


def test_restart_under_a_new_id_replaces_the_old_entry(registry):
    registry.register(worker("a"), Load())
    registry.register(Worker("a2", Role.DECODE, "a.local:1", "m"), Load())
    assert [r.worker_id for r in registry.records()] == ["a2"]


def test_a_worker_claiming_prefixes_it_was_never_sent_does_not_capture_routing(clock):
    """Issue 48: a worker whose events claim the blocks of a popular prefix (a system
    prompt's) it does not hold won every prompt starting with it under prefix_aware. A claim
    counts only for blocks the router sent that worker: the liar's events and snapshot are
    dropped and the prompts go where they went before; once it was sent some of the blocks,
    those count; a new registration starts with nothing vouched for (--check-prefix-claims)."""
    registry = WorkerRegistry(worker_timeout_s=5.0, clock=clock, check_claims=True)
    policy = make_policy("prefix_aware")
    system_prompt = [31, 32, 33, 34, 35, 36]
    registry.register(worker("honest"), Load(num_running=2))
    registry.note_routed("honest", block_hashes=system_prompt)
    hold(registry, "honest", [])  # synced, empty; then its events
    assert registry.get("honest").kv.apply(kv_events_pb2.KVEventBatch(incarnation=1, first_seq=1, events=[
        kv_events_pb2.KVEvent(tier="device", kind=kv_events_pb2.KV_EVENT_KIND_STORED, block_hashes=system_prompt)]))
    registry.register(worker("rogue"), Load())
    index = registry.get("rogue").kv
    index.begin_sync()
    assert index.finish_sync(kv_events_pb2.KVSnapshotResponse(incarnation=1, last_seq=0, tiers=[
        kv_events_pb2.KVTierBlocks(tier="device", block_hashes=system_prompt + [99])]))
    assert index.apply(kv_events_pb2.KVEventBatch(incarnation=1, first_seq=1, events=[
        kv_events_pb2.KVEvent(tier="host", kind=kv_events_pb2.KV_EVENT_KIND_STORED, block_hashes=system_prompt)]))
    assert index.num_blocks == 0 and registry.get("rogue").num_matched_blocks(system_prompt) == 0
    query = RouteQuery((*system_prompt, 40), num_prompt_tokens=120, block_size=16)
    picks = [policy.choose(registry.routable(Role.DECODE, "m"), query).record.worker_id for _ in range(100)]
    assert picks == ["honest"] * 100
    registry.note_routed("rogue", block_hashes=system_prompt[:2])  # sent the first two blocks: those count
    assert index.apply(kv_events_pb2.KVEventBatch(incarnation=1, first_seq=2, events=[
        kv_events_pb2.KVEvent(tier="device", kind=kv_events_pb2.KV_EVENT_KIND_STORED, block_hashes=system_prompt)]))
    assert registry.get("rogue").num_matched_blocks(system_prompt) == 2
    assert registry.deregister("rogue")
    registry.register(worker("rogue"), Load())
    assert registry.routed.vouched("rogue", system_prompt) == []


def test_routed_prefixes_are_bounded_per_worker():
    from pdserve.router.prefix_claims import RoutedPrefixes

    routed = RoutedPrefixes(max_per_worker=3)
    routed.note("a", [1, 2, 3])
    routed.note("a", [4, 1])  # 1 refreshed, 2 the oldest: forgotten
    assert routed.vouched("a", [1, 2, 3, 4, 5]) == [1, 3, 4] and routed.vouched("b", [1]) == []


def test_round_robin_cycles(registry):
    for name in "abc":
        registry.register(worker(name), Load())
    policy = make_policy("round_robin")
    picks = [policy.choose(registry.routable(Role.DECODE, "m"), RouteQuery()).record.worker_id for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_counts_what_was_sent_since_the_last_report(registry):
    registry.register(worker("a"), Load(num_queued=1, num_running=2))
    registry.register(worker("b"), Load(num_running=1))
    policy = make_policy("least_loaded")
    choice = policy.choose(registry.routable(Role.DECODE, "m"), RouteQuery())
    assert (choice.record.worker_id, choice.reason) == ("b", "least_loaded")
    registry.note_routed("b")
    registry.note_routed("b")  # b now 3, a 3: a tie, which rotates
    picks = {policy.choose(registry.routable(Role.DECODE, "m"), RouteQuery()).record.worker_id for _ in range(2)}
    assert picks == {"a", "b"}


def test_prefix_aware_prefers_the_longest_cached_run_then_the_least_loaded(registry):
    registry.register(worker("a"), Load(num_running=5))
    hold(registry, "a", [11, 12, 13])
    registry.register(worker("b"), Load())
    hold(registry, "b", [11])
    registry.register(worker("c"), Load(num_running=1))
    hold(registry, "c", [11, 12, 13, 99])
    policy = make_policy("prefix_aware")
    candidates = registry.routable(Role.DECODE, "m")
    choice = policy.choose(candidates, RouteQuery((11, 12, 13, 14)))
    assert (choice.record.worker_id, choice.reason) == ("c", "prefix_match")  # a ties on length, c less loaded
    choice = policy.choose(candidates, RouteQuery((50, 51)))
    assert (choice.record.worker_id, choice.reason) == ("b", "no_prefix_match")


def test_prefix_aware_keeps_affinity_only_where_it_pays_and_the_pool_stays_balanced(registry):
    """A shared chat-template block is not worth affinity (the chats spread); a long shared
    prefix is, until its worker is more than max_load_gap requests busier than the least loaded."""
    policy = make_policy("prefix_aware")
    registry.register(worker("a"), Load())
    hold(registry, "a", [1, 2, 3, 4, 5, 6])
    registry.register(worker("b"), Load())
    template_only = RouteQuery((1, 70), num_prompt_tokens=40, block_size=16)  # 16 of 40 tokens cached on a
    spread = [policy.choose(registry.routable(Role.DECODE, "m"), template_only) for _ in range(4)]
    assert {c.reason for c in spread} == {"short_prefix_match"}
    assert sorted(c.record.worker_id for c in spread) == ["a", "a", "b", "b"]
    long_prefix = RouteQuery((1, 2, 3, 4, 5, 6, 80), num_prompt_tokens=120, block_size=16)
    choice = policy.choose(registry.routable(Role.DECODE, "m"), long_prefix)
    assert (choice.record.worker_id, choice.reason) == ("a", "prefix_match")
    registry.heartbeat("a", Load(num_running=5))
    choice = policy.choose(registry.routable(Role.DECODE, "m"), long_prefix)
    assert (choice.record.worker_id, choice.reason) == ("b", "load_imbalance")


def test_session_affinity_is_sticky_and_consistent(registry):
    for name in "abcd":
        registry.register(worker(name), Load())
    policy = make_policy("session_affinity")
    candidates = registry.routable(Role.DECODE, "m")
    homes = {s: policy.choose(candidates, RouteQuery(session_key=s)).record.worker_id for s in map(str, range(40))}
    assert len(set(homes.values())) > 1
    assert all(policy.choose(candidates, RouteQuery(session_key=s)).record.worker_id == h for s, h in homes.items())
    without_b = [r for r in candidates if r.worker_id != "b"]
    for session, home in homes.items():  # losing b moves only b's sessions
        if home != "b":
            assert policy.choose(without_b, RouteQuery(session_key=session)).record.worker_id == home
    assert policy.choose(candidates, RouteQuery()).reason == "no_session"


def test_unknown_policy_name():
    with pytest.raises(ValueError):
        make_policy("random")


def make_planner(registry, threshold: int = 8, queue_threshold: int = 4) -> tuple[RoutePlanner, RouterMetrics]:
    metrics = RouterMetrics()
    return RoutePlanner(registry, make_policy("prefix_aware"), make_policy("round_robin"), threshold,
                        queue_threshold, metrics), metrics


def decisions(metrics: RouterMetrics, pool: str, policy: str, reason: str) -> float:
    return metrics.registry.get_sample_value("pdserve_router_routing_decisions_total",
                                             {"pool": pool, "policy": policy, "reason": reason}) or 0.0


def test_planner_conditional_disaggregation_reasons(registry):
    planner, metrics = make_planner(registry)
    with pytest.raises(EXPECTED_ERRORS) as caught:
        planner.plan("r0", "m", 40, 4, [], "")
    assert caught.value.kind is ErrorKind.UNAVAILABLE

    registry.register(worker("d"), Load())
    hold(registry, "d", [1, 2, 3, 4, 5, 6, 7, 8])
    plan = planner.plan("r1", "m", 40, 4, list(range(90, 100)), "")
    assert (plan.prefill, plan.prefill_reason) == (None, "no_prefill_worker")

    registry.register(worker("p", Role.PREFILL), Load(num_queued=3))
    plan = planner.plan("r2", "m", 40, 4, list(range(1, 11)), "")  # 8 blocks cached: 8 uncached tokens
    assert (plan.prefill, plan.prefill_reason, plan.num_matched_tokens) == (None, "short_uncached_prompt", 32)
    plan = planner.plan("r3", "m", 40, 4, list(range(50, 60)), "")
    assert plan.prefill.worker_id == "p" and plan.prefill_reason == "round_robin"
    assert plan.prefill_queue_length == 3 and plan.decode_reason == "no_prefix_match"
    assert decisions(metrics, "prefill", "round_robin", "short_uncached_prompt") == 1
    assert decisions(metrics, "prefill", "round_robin", "no_prefill_worker") == 1
    assert decisions(metrics, "decode", "prefix_aware", "prefix_match") == 1
    assert decisions(metrics, "decode", "prefix_aware", "no_prefix_match") == 2
    # What was routed is not guessed cached: d's events say it, here into its host tier.
    assert planner.plan("r4", "m", 40, 4, list(range(50, 60)), "").decode_reason == "no_prefix_match"
    assert registry.get("d").kv.apply(kv_events_pb2.KVEventBatch(incarnation=1, first_seq=1, events=[
        kv_events_pb2.KVEvent(tier="host", kind=kv_events_pb2.KV_EVENT_KIND_STORED, block_hashes=range(50, 60))]))
    plan = planner.plan("r4", "m", 40, 4, list(range(50, 60)), "")
    assert (plan.decode_reason, plan.num_matched_tokens) == ("prefix_match_host", 40)
    assert metrics.registry.get_sample_value("pdserve_router_matched_prefix_tokens_total", {"tier": "host"}) == 40
    assert metrics.registry.get_sample_value("pdserve_router_matched_prefix_tokens_total", {"tier": "device"}) == 32
    # A prefill queue at the threshold: decode prefills locally, and says why.
    registry.heartbeat("p", Load(num_queued=4))
    plan = planner.plan("r5", "m", 40, 4, [60, 61], "")
    assert (plan.prefill, plan.prefill_reason, plan.prefill_queue_length) == (None, "prefill_queue_long", 0)
    assert decisions(metrics, "prefill", "round_robin", "prefill_queue_long") == 1


def test_planner_prefills_locally_while_no_kv_backend_could_carry_the_blocks(registry):
    """A prefill whose every backend shared with the decode is reported unusable is not asked
    (it would compute the prompt only for decode to compute it again); a report that its
    probe is due brings it back. A backend only one side speaks never counts."""
    planner, metrics = make_planner(registry, threshold=0)
    ucx_redis = ("ucx", "redis", "recompute")
    registry.register(dataclasses.replace(worker("d"), kv_backends=("redis", "recompute")), Load())
    registry.register(dataclasses.replace(worker("p", Role.PREFILL), kv_backends=ucx_redis), Load())
    assert planner.plan("r1", "m", 40, 4, [], "").prefill.worker_id == "p"
    down = (KVBackendState("ucx", True), KVBackendState("redis", False, "unhealthy after 3 failures"))
    registry.heartbeat("p", Load(kv_backends=down))  # ucx is fine, but decode does not speak it
    plan = planner.plan("r2", "m", 40, 4, [], "")
    assert (plan.prefill, plan.prefill_reason) == (None, "no_usable_kv_backend")
    assert decisions(metrics, "prefill", "round_robin", "no_usable_kv_backend") == 1
    registry.heartbeat("p", Load(kv_backends=(KVBackendState("redis", True),)))  # the probe is due
    assert planner.plan("r3", "m", 40, 4, [], "").prefill.worker_id == "p"
    registry.heartbeat("d", Load(kv_backends=(KVBackendState("redis", False, "fetch failed"),)))
    assert planner.plan("r4", "m", 40, 4, [], "").prefill_reason == "no_usable_kv_backend"


def test_planner_skips_excluded_and_suspect_workers(registry):
    planner, _ = make_planner(registry)
    registry.register(worker("a"), Load())
    registry.register(worker("b"), Load())
    assert planner.plan("r", "m", 40, 4, [], "", exclude={"a"}).decode.worker_id == "b"
    registry.mark_suspect("b", "refused")
    with pytest.raises(EXPECTED_ERRORS):
        planner.plan("r", "m", 40, 4, [], "", exclude={"a"})


def counters(transfers: int = 0, tail_s: float = 0.0, peer: str = "p", blocks: int = 50,
             block_bytes: int = 1000, seconds: float = 0.05):
    """A decode's report of the link from `peer`: `transfers` of `blocks` blocks, each taking
    `seconds` and a tail of `tail_s`."""
    from pdserve.proto.pdserve.v1 import common_pb2

    return common_pb2.EngineCounters(received=[common_pb2.PeerTransferCounters(
        peer=peer, transfers=transfers, bytes_per_block=block_bytes, bytes_per_s=blocks * block_bytes / seconds,
        tail_s=tail_s)])


def test_planner_routes_by_predicted_time_to_first_token(registry, clock):
    """Between the static bounds, each prompt goes where its first token is predicted
    sooner: queued prompt tokens (reported, plus those routed since) over each side's prefill
    rate, the transfer on the remote side, the stall of the decode's streams on the local one.
    One prompt to idle workers stays disaggregated; 8 prompts of 200 tokens at once to equally
    fast workers alternate, so neither queue holds more than half the burst."""
    planner, metrics = make_planner(registry, threshold=8, queue_threshold=100)
    registry.register(worker("d"), Load(prefill_tokens_per_s=400.0, counters=counters(10, tail_s=0.05)))
    registry.register(worker("p", Role.PREFILL), Load(prefill_tokens_per_s=400.0))
    paths = []
    for i in range(8):  # remote, local, remote, ...: local once it saves more than its stall
        plan = planner.plan(f"r{i}", "m", 200, 4, [1000 + 100 * i + j for j in range(50)], "")
        paths.append(plan.prefill.worker_id if plan.prefill else plan.prefill_reason)
        assert plan.prediction is not None
    assert paths == ["p", "predicted_faster_local"] * 4
    assert decisions(metrics, "prefill", "round_robin", "predicted_faster_local") == 4
    assert registry.get("d").queued_prompt_tokens() == registry.get("p").queued_prompt_tokens() == 800

    # A report taken before the burst arrived keeps it counted beside the report; once the
    # burst has settled, reports replace the guesses.
    registry.heartbeat("p", Load(prefill_tokens_per_s=400.0, queued_prompt_tokens=0))
    assert registry.get("p").queued_prompt_tokens() == 800
    # A long queue on the prefill worker sends the next prompt local; a decode that
    # prefills 4x slower keeps it remote.
    clock.now += ROUTED_SETTLE_S + 0.1
    registry.heartbeat("p", Load(prefill_tokens_per_s=400.0, queued_prompt_tokens=2000))
    registry.heartbeat("d", Load(prefill_tokens_per_s=400.0, queued_prompt_tokens=0))
    plan = planner.plan("r8", "m", 200, 4, [7], "")
    assert plan.prefill is None and plan.prefill_reason == "predicted_faster_local"
    assert plan.prediction.local_s == pytest.approx(0.5) and plan.prediction.remote_s == pytest.approx(5.5)  # the new report has no transfers yet
    assert plan.prediction.stall_s == pytest.approx(0.5)
    # A decode with 8 streams decoding pauses them all for the prompt's 0.5 s, side by side:
    # the stall is charged once, so it takes the prompt once the prefill queue ahead is
    # longer than that stall plus its own compute.
    clock.now += ROUTED_SETTLE_S + 0.1  # what was routed since has reached its worker
    registry.heartbeat("p", Load(prefill_tokens_per_s=400.0, queued_prompt_tokens=200))
    registry.heartbeat("d", Load(prefill_tokens_per_s=400.0, num_decoding=8))
    plan = planner.plan("r8b", "m", 200, 4, [70], "")
    assert plan.prefill.worker_id == "p" and plan.prediction.num_stalled == 8
    assert plan.prediction.local_s + plan.prediction.stall_s == pytest.approx(plan.prediction.remote_s)
    clock.now += ROUTED_SETTLE_S + 0.1  # what was routed since has reached its worker
    registry.heartbeat("p", Load(prefill_tokens_per_s=400.0, queued_prompt_tokens=400))
    registry.heartbeat("d", Load(prefill_tokens_per_s=400.0, num_decoding=8))
    assert planner.plan("r8c", "m", 200, 4, [71], "").prefill_reason == "predicted_faster_local"
    clock.now += ROUTED_SETTLE_S + 0.1  # what was routed since has reached its worker
    registry.heartbeat("p", Load(prefill_tokens_per_s=400.0, queued_prompt_tokens=200))
    registry.heartbeat("d", Load(prefill_tokens_per_s=100.0, queued_prompt_tokens=0))
    plan = planner.plan("r9", "m", 200, 4, [8], "")
    assert plan.prefill.worker_id == "p"
    assert plan.prediction.local_s == pytest.approx(2.0) and plan.prediction.remote_s == pytest.approx(1.0)


def test_the_link_between_a_pair_is_charged_on_the_remote_side(registry, clock):
    """What the decode received from the prefill worker prices the transfer: its mean tail
    past the forward, or, on a link too slow for the stream to keep up with the forward, the
    time the link needs for this prompt's bytes beyond the forward. On a fast link a 2,048-
    token prompt goes to the prefill worker; on a slow one (50 MB/s for 128 blocks of 1 MB
    each: 2.56 s, the forward 1.02 s) to the decode's own prefill, with the numbers that
    decided it. A link never measured costs nothing."""
    planner, _ = make_planner(registry, threshold=8, queue_threshold=100)
    fast = counters(4, tail_s=0.01, blocks=128, block_bytes=2**20, seconds=0.05)
    slow = counters(4, tail_s=1.5, blocks=128, block_bytes=2**20, seconds=128 * 2**20 / 50e6)
    registry.register(worker("p", Role.PREFILL), Load(prefill_tokens_per_s=2000.0))
    registry.register(worker("d"), Load(prefill_tokens_per_s=1600.0, counters=fast))
    plan = planner.plan("r1", "m", 2048, 16, [1], "")
    assert plan.prefill.worker_id == "p" and plan.prediction.transfer_s == pytest.approx(0.01)
    clock.now += ROUTED_SETTLE_S + 0.1  # the next reports come after r1 reached "p"
    registry.heartbeat("p", Load(prefill_tokens_per_s=2000.0))
    registry.heartbeat("d", Load(prefill_tokens_per_s=1600.0, counters=slow))
    plan = planner.plan("r2", "m", 2048, 16, [2], "")
    assert plan.prefill is None and plan.prefill_reason == "predicted_faster_local"
    wire_s = 128 * 2**20 / 50e6
    assert plan.prediction.transfer_s == pytest.approx(wire_s - 2048 / 2000)
    assert plan.prediction.remote_s == pytest.approx(2048 / 2000 + wire_s - 2048 / 2000)
    registry.heartbeat("d", Load(prefill_tokens_per_s=1600.0, counters=counters(4, tail_s=9.0, peer="other")))
    assert planner.plan("r3", "m", 2048, 16, [3], "").prediction.transfer_s == 0.0  # this pair: never measured


def test_a_link_priced_out_of_use_is_probed_once_per_interval(registry, clock, caplog):
    """A slow link keeps 2,048-token prompts on the decode, and only a transfer could show it
    healed: once its measurement is 30 s old the next such prompt goes over it anyway
    ("link_probe", with the age in the log), the ones after it stay local until the probe's
    transfer is reported, and a link still slow is probed again only 30 s later. A prompt
    that would stay local without the link's cost is never sent as a probe."""
    slow = counters(4, tail_s=1.5, blocks=128, block_bytes=2**20, seconds=128 * 2**20 / 50e6)
    fast = counters(5, tail_s=0.01, blocks=128, block_bytes=2**20, seconds=0.05)
    metrics = RouterMetrics()
    planner = RoutePlanner(registry, make_policy("prefix_aware"), make_policy("round_robin"), 8, 100, metrics,
                           probes=LinkProbes(30.0, clock))

    def report(decode_counters, prefill_queue: int = 0) -> None:  # registers again: the clock jumps
        registry.register(worker("p", Role.PREFILL), Load(prefill_tokens_per_s=2000.0,
                                                          queued_prompt_tokens=prefill_queue))
        registry.register(worker("d"), Load(prefill_tokens_per_s=1600.0, counters=decode_counters))

    def route(name: str) -> str:
        plan = planner.plan(name, "m", 2048, 16, [hash(name)], "")
        return plan.prefill.worker_id + ":" + plan.prefill_reason if plan.prefill else plan.prefill_reason

    report(slow)
    assert route("r1") == "predicted_faster_local"  # the link's age starts now
    clock.now += 29.0
    report(slow)
    assert route("r2") == "predicted_faster_local"
    clock.now += 1.0
    report(slow)
    with caplog.at_level("INFO", logger="pdserve.router.planner"):
        assert route("r3") == "p:link_probe"
    assert "link p->d last measured 30 s ago: this prompt probes it" in caplog.text
    assert decisions(metrics, "prefill", "round_robin", "link_probe") == 1
    report(slow)
    assert route("r4") == "predicted_faster_local"  # one probe at a time
    report(fast)  # the probe's transfer: the link healed
    assert route("r5") == "p:round_robin"

    report(counters(6, tail_s=1.5, blocks=128, block_bytes=2**20, seconds=128 * 2**20 / 50e6))  # slow again
    assert route("r6") == "predicted_faster_local"
    clock.now += 30.0
    report(counters(6, tail_s=1.5, blocks=128, block_bytes=2**20, seconds=128 * 2**20 / 50e6))
    assert route("r7") == "p:link_probe"
    clock.now += 15.0  # the probe failed (the count never moved): the next waits a whole interval
    report(counters(6, tail_s=1.5, blocks=128, block_bytes=2**20, seconds=128 * 2**20 / 50e6))
    assert route("r8") == "predicted_faster_local"
    clock.now += 15.0
    report(counters(6, tail_s=1.5, blocks=128, block_bytes=2**20, seconds=128 * 2**20 / 50e6), prefill_queue=8000)
    assert route("r9") == "predicted_faster_local"  # local even with the link free: nothing to probe
    report(counters(6, tail_s=1.5, blocks=128, block_bytes=2**20, seconds=128 * 2**20 / 50e6))
    assert route("r10") == "p:link_probe"
    assert decisions(metrics, "prefill", "round_robin", "link_probe") == 3


def test_link_probes_off_never_send_a_prompt_over_a_slow_link(registry, clock):
    slow = counters(4, tail_s=1.5, blocks=128, block_bytes=2**20, seconds=128 * 2**20 / 50e6)
    planner = RoutePlanner(registry, make_policy("prefix_aware"), make_policy("round_robin"), 8, 100,
                           RouterMetrics(), probes=LinkProbes(0.0, clock))
    for i in range(3):
        registry.register(worker("p", Role.PREFILL), Load(prefill_tokens_per_s=2000.0))
        registry.register(worker("d"), Load(prefill_tokens_per_s=1600.0, counters=slow))
        assert planner.plan(f"r{i}", "m", 2048, 16, [i], "").prefill_reason == "predicted_faster_local"
        clock.now += 3600.0


def test_the_first_burst_is_split_before_any_rate_is_measured(registry):
    """Just after start neither worker has measured its prefill rate: 8 prompts at once are
    ranked by queued tokens (the same model on both sides), so the idle decode takes its
    share instead of waiting while one prefill worker computes all eight."""
    planner, metrics = make_planner(registry, threshold=8, queue_threshold=100)
    registry.register(worker("d"), Load())
    registry.register(worker("p", Role.PREFILL), Load())
    paths = []
    for i in range(8):
        plan = planner.plan(f"r{i}", "m", 200, 4, [2000 + 100 * i + j for j in range(50)], "")
        assert plan.prediction is not None and not plan.prediction.measured
        paths.append(plan.prefill.worker_id if plan.prefill else plan.prefill_reason)
    # local once the prefill queue ahead is longer than the decode's own plus the stall
    assert paths == ["p", "p"] + ["predicted_faster_local", "p"] * 3
    assert registry.get("d").queued_prompt_tokens() == 600 and registry.get("p").queued_prompt_tokens() == 1000


def test_planner_thresholds_bound_the_prediction(registry):
    """A short uncached prompt stays local and a queue at the threshold sends it local
    whatever the prediction says; a prefill worker that has not measured its rate yet is
    taken to prefill at the decode's."""
    planner, _ = make_planner(registry, threshold=8, queue_threshold=4)
    registry.register(worker("d"), Load(prefill_tokens_per_s=1.0))
    registry.register(worker("p", Role.PREFILL), Load())
    plan = planner.plan("r1", "m", 200, 4, [1], "")
    assert plan.prefill.worker_id == "p" and plan.prediction.measured
    assert plan.prediction.remote_s == pytest.approx(200.0)  # the decode's 1 token/s
    registry.heartbeat("p", Load(prefill_tokens_per_s=1e6))
    assert planner.plan("r2", "m", 8, 4, [2], "").prefill_reason == "short_uncached_prompt"
    registry.heartbeat("p", Load(num_queued=4, prefill_tokens_per_s=1e6))
    assert planner.plan("r3", "m", 200, 4, [3], "").prefill_reason == "prefill_queue_long"


def test_static_routing_asks_the_prefill_worker_between_the_thresholds(registry):
    planner = RoutePlanner(registry, make_policy("prefix_aware"), make_policy("round_robin"), 8, 100,
                           RouterMetrics(), predict=False)
    registry.register(worker("d"), Load(prefill_tokens_per_s=1e6))
    registry.register(worker("p", Role.PREFILL), Load(prefill_tokens_per_s=1.0, queued_prompt_tokens=10**6))
    plan = planner.plan("r1", "m", 200, 4, [1], "")
    assert plan.prefill.worker_id == "p" and plan.prediction is None


def test_a_decode_reports_what_each_prefill_worker_delivered():
    """The decode's load report carries, per prefill worker, the link as recent transfers saw
    it (what `transfer_cost` prices): bytes per block, bytes/s as the sender timed them, the
    tail past the forward; each new transfer weighs half, so a link that slowed shows within
    a few transfers. A verdict with no peer is not counted."""
    from pdserve.kvtransfer.verdict import Landing, TransferVerdict
    from pdserve.worker.metrics import WorkerMetrics

    metrics = WorkerMetrics("decode")

    def landed(seconds: float, tail_ms: float, peer: str = "prefill-0") -> None:
        metrics.observe_received(TransferVerdict("t", Landing.LANDED, "ucx", num_blocks=8, num_bytes=8000,
                                                 duration_s=seconds, peer=peer), tail_ms=tail_ms)

    landed(0.25, 40.0)
    landed(0.25, 40.0)
    landed(1.0, 40.0, peer="")

    class Stats:
        num_prompt_tokens_computed = num_generation_tokens = num_prefix_queries = num_prefix_hits = 0
        num_preemptions = num_steps = 0
        step_seconds = 0.0

    (link,) = metrics.counters(Stats()).received
    assert (link.peer, link.transfers, link.bytes_per_block) == ("prefill-0", 2, 1000)
    assert link.bytes_per_s == pytest.approx(32000) and link.tail_s == pytest.approx(0.04)
    for _ in range(3):  # the link slows down 8x
        landed(2.0, 400.0)
    (link,) = metrics.counters(Stats()).received
    assert 4000 < link.bytes_per_s < 8000 and link.tail_s > 0.3


def test_prefix_aware_weighs_where_the_blocks_are_against_load(registry):
    """The same run of blocks scores highest on a device pool, then host memory, then disk;
    a holder too busy (more than max_load_gap above the least loaded) gives way to the next."""
    policy = make_policy("prefix_aware")
    prompt = RouteQuery((1, 2, 3, 4), num_prompt_tokens=64, block_size=16)
    for name, tier in (("a", "disk"), ("b", "host"), ("c", "device")):
        registry.register(worker(name), Load())
        hold(registry, name, [1, 2, 3, 4], tier)
    assert (policy.choose(registry.routable(Role.DECODE, "m"), prompt).record.worker_id) == "c"
    registry.heartbeat("c", Load(num_running=5))
    choice = policy.choose(registry.routable(Role.DECODE, "m"), prompt)
    assert (choice.record.worker_id, choice.reason) == ("b", "prefix_match_host")
    registry.heartbeat("b", Load(num_running=5))
    choice = policy.choose(registry.routable(Role.DECODE, "m"), prompt)
    assert (choice.record.worker_id, choice.reason) == ("a", "prefix_match_disk")
    registry.heartbeat("a", Load(num_running=9))  # every holder busy: the least loaded, and why
    registry.register(worker("e"), Load())
    choice = policy.choose(registry.routable(Role.DECODE, "m"), prompt)
    assert (choice.record.worker_id, choice.reason) == ("e", "load_imbalance")


def test_a_prefix_only_the_decode_holds_is_priced_as_recomputed_remotely(registry):
    """A chat's next turn: the decode holds the history (its answers included) and lacks only
    the new message; the prefill worker holds none of it. Remote, the prefill worker would
    compute the whole prompt again; local, the decode computes the new message alone. The
    prediction charges each side what it lacks, so the turn stays on the decode."""
    planner, metrics = make_planner(registry, threshold=8, queue_threshold=100)
    registry.register(worker("d"), Load(prefill_tokens_per_s=400.0))
    registry.register(worker("p", Role.PREFILL), Load(prefill_tokens_per_s=400.0))
    history = list(range(5000, 5150))  # 150 blocks of 4 tokens: 600 tokens held by the decode
    hold(registry, "d", history, tier="host")
    blocks = history + [9000 + i for i in range(16)]  # the new message: 64 tokens
    plan = planner.plan("turn", "m", len(blocks) * 4, 4, blocks, "")
    assert plan.prefill is None and plan.prefill_reason == "predicted_faster_local"
    assert plan.prediction.local_s == pytest.approx(64 / 400.0)
    assert plan.prediction.remote_s == pytest.approx(664 / 400.0)
    # once the prefill worker holds the history too, it computes the new message alone, and
    # with the decode's queue now ahead (the first turn's 64 tokens) the next turn goes there
    hold(registry, "p", history)
    plan = planner.plan("turn-2", "m", len(blocks) * 4, 4, blocks, "")
    assert plan.prediction.remote_s == pytest.approx(64 / 400.0)
    assert plan.prediction.local_s == pytest.approx(128 / 400.0)
    assert plan.prefill.worker_id == "p"


def test_a_report_forgets_only_what_was_routed_before_it_settled(registry, clock):
    """A report may have been taken before the requests routed just now reached the worker:
    those keep counting beside it (load and prompt tokens) until ROUTED_SETTLE_S has passed,
    and the next report after that replaces them."""
    registry.register(worker("d"), Load())
    registry.note_routed("d", 300)
    clock.now += ROUTED_SETTLE_S + 0.1
    registry.note_routed("d", 200)
    registry.heartbeat("d", Load(num_running=1, queued_prompt_tokens=300))  # has the first only
    record = registry.get("d")
    assert (record.load_score(), record.queued_prompt_tokens()) == (2, 500)
    clock.now += ROUTED_SETTLE_S + 0.1
    registry.heartbeat("d", Load(num_running=2, queued_prompt_tokens=500))
    assert (record.load_score(), record.queued_prompt_tokens()) == (2, 500)

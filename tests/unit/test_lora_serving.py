"""LoRA at the serving edge: the flags (one table for `up`, prefill and decode), the router's
view of which workers serve and hold an adapter, routing to holders against load, and
/v1/models' listing with parents."""
from __future__ import annotations

import json

import pytest

from pdserve.common.errors import InvalidRequestError, NotFoundError
from pdserve.deploy import cli, up
from pdserve.proto.pdserve.v1 import common_pb2
from pdserve.router.adapters import AdapterDirectory
from pdserve.router.config import Role
from pdserve.router.membership import load_from_proto
from pdserve.router.policies import LeastLoaded, adapter_candidates
from pdserve.router.worker_registry import Worker, WorkerRegistry
from pdserve.worker.lora import LoraModule
from pdserve.worker.settings import SettingsError, WorkerSettings


def _settings(argv: list[str]) -> WorkerSettings:
    args = cli.build_parser().parse_args(["decode", *argv])
    return WorkerSettings.from_settings("decode", cli.resolve(args, environ={}))


def test_lora_modules_take_both_forms_repeated_or_listed():
    entry = json.dumps({"name": "sql", "path": "/a/sql", "base_model_name": "smol"})
    s = _settings(["--enable-lora", "--lora-modules", "chat=/a/chat", "math=/a/math", "--lora-modules", entry,
                   "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "3",
                   "--lora-allowed-root", "/a"])
    lora = s.lora()
    assert lora.modules == (LoraModule("chat", "/a/chat"), LoraModule("math", "/a/math"),
                            LoraModule("sql", "/a/sql", "smol"))
    assert (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras, lora.allowed_root) == (2, 8, 3, "/a")
    assert lora.engine_fields() == {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 3,
                                    "lora_allowed_root": "/a"}
    assert _settings([]).lora().engine_fields() == {}  # off: the engine's defaults


def test_lora_modules_from_the_environment_and_yaml(tmp_path):
    args = cli.build_parser().parse_args(["decode"])
    merged = cli.resolve(args, environ={"PDSERVE_ENABLE_LORA": "1",
                                        "PDSERVE_LORA_MODULES": '["a=/x", {"name": "b", "path": "/y"}]'})
    assert WorkerSettings.from_settings("decode", merged).lora().modules == (LoraModule("a", "/x"),
                                                                             LoraModule("b", "/y"))
    config = tmp_path / "c.yaml"
    config.write_text("enable_lora: true\nlora_modules: [a=/x, b=/y]\n")
    merged = cli.resolve(cli.build_parser().parse_args(["decode", "--config", str(config)]), environ={})
    assert [m.name for m in WorkerSettings.from_settings("decode", merged).lora().modules] == ["a", "b"]


@pytest.mark.parametrize("argv, problem", [
    (["--lora-modules", "a=/x"], "needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "noequals"], "NAME=PATH"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "more than once"),
    (["--enable-lora", "--lora-modules", "{\"name\": \"a\"}"], "expected"),
    (["--enable-lora", "--lora-modules", "{not json"], "not JSON"),
    (["--enable-lora", "--lora-modules", "bad name=/x"], "lora_name"),
    (["--enable-lora", "--max-cpu-loras", "1", "--max-loras", "2"], "--max-cpu-loras"),
])
def test_malformed_lora_settings_stop_the_start(argv, problem):
    with pytest.raises(SettingsError, match=problem):
        _settings(argv)


def test_up_passes_the_lora_flags_to_every_worker_and_turns_on_the_router_endpoints():
    shared = set(cli.worker_pass_through())
    assert {"enable_lora", "lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras",
            "lora_allowed_root"} <= shared
    children, _ = up.plan({"enable_lora": True, "lora_modules": ["a=/x", "b=/y"], "num_prefill": 1,
                           "num_decode": 1, "cluster_secret_file": "/s"})
    router = next(c for c in children if c.name == "router")
    assert "--enable-lora" in router.argv and "--lora-modules" not in router.argv
    for worker in (c for c in children if c.name != "router"):
        argv = worker.argv
        assert "--enable-lora" in argv
        assert [argv[i + 1] for i, a in enumerate(argv) if a == "--lora-modules"] == ["a=/x", "b=/y"]
        assert _settings(argv[argv.index("--enable-lora"):]).lora().modules == (LoraModule("a", "/x"),
                                                                                LoraModule("b", "/y"))


def _adapter(name: str, loaded: bool, base: str = "") -> common_pb2.LoraAdapterState:
    return common_pb2.LoraAdapterState(name=name, loaded=loaded, base_model_name=base,
                                       digest="d" * 8 if loaded else "")


def _registry(workers: dict[str, tuple[int, list]], role: Role = Role.DECODE) -> WorkerRegistry:
    registry = WorkerRegistry(worker_timeout_s=60)
    for port, (worker_id, (running, adapters)) in enumerate(workers.items(), start=5000):
        report = common_pb2.WorkerLoad(num_running=running, num_total_blocks=64, lora_adapters=adapters)
        registry.register(Worker(worker_id, role, f"127.0.0.1:{port}", "smol"), load_from_proto(report))
    return registry


def test_holders_of_the_adapter_win_while_load_allows():
    registry = _registry({"d0": (0, []), "d1": (2, [_adapter("a", True)]), "d2": (1, [_adapter("a", False)])})
    records = registry.routable(Role.DECODE, "smol")
    chosen, why = adapter_candidates(records, "a")
    assert [r.worker_id for r in chosen] == ["d1"] and why == "lora_holder"
    assert LeastLoaded().choose(chosen, None).record.worker_id == "d1"  # though d2 is less loaded
    # a worker that neither holds nor may load it is never a candidate
    assert [r.worker_id for r in adapter_candidates(records, "b")[0]] == []
    assert [r.worker_id for r in adapter_candidates(records, "")[0]] == ["d0", "d1", "d2"]


def test_load_beats_a_holder_that_is_far_busier():
    registry = _registry({"d1": (9, [_adapter("a", True)]), "d2": (1, [_adapter("a", False)])})
    chosen, why = adapter_candidates(registry.routable(Role.DECODE, "smol"), "a", max_load_gap=4)
    assert {r.worker_id for r in chosen} == {"d1", "d2"} and why == "lora_load_imbalance"
    none_loaded = _registry({"d1": (0, [_adapter("a", False)]), "d2": (0, [])})
    chosen, why = adapter_candidates(none_loaded.routable(Role.DECODE, "smol"), "a")
    assert [r.worker_id for r in chosen] == ["d1"] and why == "lora_load"


def test_directory_lists_adapters_with_their_parent_and_forgets_unloaded_ones():
    registry = _registry({"d1": (0, [_adapter("a", True), _adapter("b", False, base="Smol-Base")]),
                          "d2": (0, [_adapter("a", False)])})
    directory = AdapterDirectory(registry)
    assert [(a.name, a.model_name, a.parent) for a in directory.served()] == [
        ("a", "smol", "smol"), ("b", "smol", "Smol-Base")]
    assert directory.find("a").model_name == "smol" and directory.find("zzz") is None
    registry.note_adapter_gone("d1", "a")
    registry.note_adapter_gone("d2", "a")
    assert directory.find("a") is None
    registry.note_adapter("d2", _adapter("c", True))
    assert directory.find("c").model_name == "smol"
    assert AdapterDirectory(None).served() == []


def test_reports_are_bounded():
    report = common_pb2.WorkerLoad(lora_adapters=[_adapter("x" * 200, True), _adapter("", True), _adapter("ok", True)])
    assert [a.name for a in load_from_proto(report).lora_adapters] == ["ok"]


def test_lora_module_errors_are_invalid_requests():
    with pytest.raises(InvalidRequestError):
        LoraModule.parse('{"name": "a", "path": "/x", "extra": 1}')
    assert issubclass(NotFoundError, Exception)


def test_the_planner_routes_both_legs_to_workers_serving_the_adapter_and_counts_why():
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.planner import NO_PREFILL_WORKER, RoutePlanner
    from pdserve.router.policies import make_policy

    registry = _registry({"d0": (0, []), "d1": (1, [_adapter("a", True)])})
    for port, (worker_id, adapters) in enumerate({"p0": [], "p1": [_adapter("a", False)]}.items(), start=6000):
        registry.register(Worker(worker_id, Role.PREFILL, f"127.0.0.1:{port}", "smol"),
                          load_from_proto(common_pb2.WorkerLoad(num_total_blocks=64, lora_adapters=adapters)))
    metrics = RouterMetrics(registry)
    planner = RoutePlanner(registry, make_policy("prefix_aware"), make_policy("least_loaded"), 0, 8, metrics,
                           predict=False)
    for i in range(3):
        plan = planner.plan(f"r{i}", "smol", 64, 16, [i, i + 1, i + 2, i + 3], "", lora_name="a")
        assert (plan.decode.worker_id, plan.prefill.worker_id) == ("d1", "p1")
    base = planner.plan("base", "smol", 64, 16, [90, 91, 92, 93], "")
    assert base.decode.worker_id == "d0"  # the less loaded: no adapter, no preference
    registry.note_adapter_gone("p1", "a")
    assert planner.plan("r9", "smol", 64, 16, [50, 51, 52, 53], "", lora_name="a").prefill_reason == NO_PREFILL_WORKER
    assert metrics.registry.get_sample_value("pdserve_router_routing_decisions_total",
                                             {"pool": "decode", "policy": "lora", "reason": "lora_holder"}) == 4


def test_a_migrated_request_keeps_its_adapter():
    """The router resends the request with the tokens already streamed: under the same adapter."""
    from unittest import mock

    from pdserve.router.frontend import PreparedRequest, _decode_request
    from pdserve.router.planner import MIGRATED, RoutePlan

    prepared = PreparedRequest("r1", mock.Mock(), (1, 2, 3), (), common_pb2.SamplingParams(max_tokens=8), "",
                               lora_name="a")
    decode = Worker("d1", Role.DECODE, "127.0.0.1:1", "smol")
    plan = RoutePlan(decode, "lora_holder", None, MIGRATED, 0, 0)
    first = _decode_request(prepared, plan, 0, [])
    moved = _decode_request(prepared, plan, 0, [7, 8])
    assert first.lora_name == moved.lora_name == "a" and list(moved.resumed_token_ids) == [7, 8]


def test_only_the_router_may_administer_a_workers_adapters():
    from pdserve.common.errors import AuthError
    from pdserve.security.credentials import ADMISSION_METHODS, Identity, check_role, is_bound

    check_role(Identity("router", "router"), "pdserve.v1.Adapters")
    for role in ("decode", "prefill"):
        with pytest.raises(AuthError):
            check_role(Identity(f"{role}-0", role), "pdserve.v1.Adapters")
    assert not any(m.startswith("/pdserve.v1.Adapters/") for m in ADMISSION_METHODS)  # no shared-secret call
    assert is_bound("/pdserve.v1.Adapters/LoadAdapter")  # a credential good at one worker only

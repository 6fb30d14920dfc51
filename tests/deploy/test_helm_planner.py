"""The chart's planner component: off by default; on, one Deployment running `pdserve planner`
(its args parsed by the real CLI into the planner's typed settings) under a ServiceAccount of
its own, whose Role may only get and patch the scale of this release's prefill and decode
Deployments; every manifest validates; the NetworkPolicies let it reach the router's HTTP
port, DNS and the API server and admit only metricsFrom to it; the HPA and the planner never
both scale a role. The rendering and parsing helpers are test_helm_chart's own."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

from pdserve.planner.settings import PlannerSettings

_spec = importlib.util.spec_from_file_location("helm_chart_checks", Path(__file__).with_name("test_helm_chart.py"))
checks = sys.modules.setdefault("helm_chart_checks", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(checks)

ON = {"planner": {"enabled": True, "slo": {"ttftMs": 800, "tpotMs": 60}, "decode": {"min": 1, "max": 6}}}
FULL = checks.RELEASE


@pytest.fixture(scope="module")
def chart():
    with checks.helm.Chart.load(checks.CHART_DIR) as loaded:
        yield loaded


def _docs(chart, values, is_install: bool = True) -> list[dict]:
    if is_install:
        out = checks.render_raw(chart, values, ())
    else:
        out = chart.render(values, name=checks.RELEASE, namespace=checks.NAMESPACE, is_install=False,
                           is_upgrade=True)
    return [d for path, text in sorted(out.items()) if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def _planners(doc) -> bool:
    """Not the enroller's RBAC (test_helm_enrollment checks that)."""
    return doc["metadata"]["labels"]["app.kubernetes.io/component"] != "enroller"


def _one(docs, kind: str, name: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def test_the_planner_is_off_by_default(chart):
    docs = _docs(chart, {})
    assert not [d for d in docs if "planner" in d["metadata"]["name"]]
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding", "ClusterRole") and _planners(d)]


def test_the_planner_runs_pdserve_planner_against_this_release(chart):
    chart.validate_schema(ON)
    docs = _docs(chart, ON)
    for doc in docs:
        checks.kubernetes_validate.validate(doc, checks.KUBE_VERSION, strict=True)
    deployment = _one(docs, "Deployment", f"{FULL}-planner")
    assert deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == f"{FULL}-planner" and pod["automountServiceAccountToken"] is True
    container = checks.main_container(deployment)
    namespace, settings = checks.cli_settings(container)
    assert namespace.command == "planner"
    s = PlannerSettings.from_settings(settings)
    assert (s.prefill_deployment, s.decode_deployment) == (f"{FULL}-prefill", f"{FULL}-decode")
    assert s.namespace == checks.NAMESPACE and s.router_url == f"http://{FULL}-router:8000"
    assert (s.slo().ttft_ms, s.slo().tpot_ms, s.limits().max_decode) == (800, 60, 6)
    assert checks.container_ports(container)["metrics"] == s.planner_metrics_port
    assert container["securityContext"]["runAsNonRoot"] and container["securityContext"]["readOnlyRootFilesystem"]
    # the workers keep their service account, which mounts no token: only the planner's does
    for role in checks.WORKERS + ("router",):
        assert _one(docs, "Deployment", f"{FULL}-{role}")["spec"]["template"]["spec"][
            "automountServiceAccountToken"] is False


def test_the_planners_role_may_only_get_and_patch_the_workers_scale(chart):
    docs = _docs(chart, ON)
    (role,) = [d for d in docs if d["kind"] == "Role" and _planners(d)]
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
                              "resourceNames": [f"{FULL}-prefill", f"{FULL}-decode"], "verbs": ["get", "patch"]}]
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding") and _planners(d)]
    binding = _one(docs, "RoleBinding", f"{FULL}-planner")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{FULL}-planner"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": f"{FULL}-planner",
                                    "namespace": checks.NAMESPACE}]
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    assert {f"{FULL}-prefill", f"{FULL}-decode"} <= names  # the names the Role grants exist


def test_replica_counts_are_the_planners_after_the_install(chart):
    installed = _docs(chart, ON)
    assert _one(installed, "Deployment", f"{FULL}-decode")["spec"]["replicas"] == 1
    upgraded = _docs(chart, ON, is_install=False)
    for role in checks.WORKERS:
        assert "replicas" not in _one(upgraded, "Deployment", f"{FULL}-{role}")["spec"]  # an upgrade keeps them
    assert _one(upgraded, "Deployment", f"{FULL}-router")["spec"]["replicas"] == 1


def test_network_policies_let_the_planner_reach_the_router_and_the_api_server_only(chart):
    docs = _docs(chart, ON)
    m = checks.Manifests(docs=tuple(docs), notes="", values=chart.merge_values(ON))
    planner_labels = checks.pod_labels(_one(docs, "Deployment", f"{FULL}-planner"))
    router_labels = checks.pod_labels(_one(docs, "Deployment", f"{FULL}-router"))
    assert any(checks.admits(rule, planner_labels) for rule in checks.admitting_rules(m, router_labels, 8000))
    assert not any(checks.admits(rule, planner_labels) for rule in checks.admitting_rules(m, router_labels, 50051))
    policy = _one(docs, "NetworkPolicy", f"{FULL}-planner")
    egress = policy["spec"]["egress"]
    assert {p["port"] for p in egress[-1]["ports"]} == {443, 6443} and "to" not in egress[-1]
    assert egress[0]["ports"] == [{"port": 8000, "protocol": "TCP"}]
    # nothing reaches the planner but the metrics scrapers, and only on its metrics port
    assert [rule["ports"] for rule in policy["spec"]["ingress"]] == [[{"port": 9091, "protocol": "TCP"}]]
    # its egress names no worker port: it cannot call a worker, whatever the workers admit
    values = m.values
    worker_ports = {values["prefill"]["grpcPort"], values["decode"]["grpcPort"], values["kvTransfer"]["port"],
                    values["metrics"]["port"]}
    assert not worker_ports & {p["port"] for rule in egress for p in rule["ports"]}


@pytest.mark.parametrize("values, reason", [
    ({"planner": {"enabled": True}, "decode": {"autoscaling": {"enabled": True}}},
     "both would scale the decode Deployment"),
    ({"planner": {"enabled": True, "prefill": {"min": 3, "max": 2}}}, "planner.prefill: max must be at least min"),
])
def test_a_planner_that_would_fight_or_cannot_scale_fails_the_render(chart, values, reason):
    chart.validate_schema(values)
    with pytest.raises(checks.helm.HelmRenderError, match=reason):
        checks.render_raw(chart, values, ())


def test_the_planner_reads_the_routers_metrics_with_the_metrics_token(chart):
    """The router's /metrics answers only the metrics token (issue 48): the planner scrapes
    with it, whatever the API key."""
    values = {**ON, "router": {"metricsAuth": True, "apiKeySecret": {"name": "api", "key": "k"}}}
    container = checks.main_container(_one(_docs(chart, values), "Deployment", f"{FULL}-planner"))
    _, settings = checks.cli_settings(container)
    assert settings["api_key"] == f"secret-{FULL}-metrics-token-token" and "--api-key" not in " ".join(container["args"])


def test_the_chart_with_the_planner_lints_strictly():
    report = checks.helm.lint(checks.CHART_DIR, ON, strict=True, kube_version=f"v{checks.KUBE_VERSION}")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report


# --- the profile Job ------------------------------------------------------------------------

PROFILED = {**ON, "profile": {"enabled": True, "quick": True, "numThreads": 2}}


def _profile_args(job: dict) -> "checks.argparse.Namespace":
    container = checks.main_container(job)
    assert container["command"] == ["pdserve"]
    return checks.cli.build_parser().parse_args(checks.expand_args(container))


def test_the_profile_job_is_off_by_default(chart):
    docs = _docs(chart, ON)
    assert not [d for d in docs if d["kind"] in ("Job", "PersistentVolumeClaim")]
    container = checks.main_container(_one(docs, "Deployment", f"{FULL}-planner"))
    assert not [a for a in container["args"] if a.startswith("--planner-profile")]


def test_the_profile_job_measures_the_workers_model_into_the_planners_volume(chart):
    chart.validate_schema(PROFILED)
    docs = _docs(chart, PROFILED)
    for doc in docs:
        checks.kubernetes_validate.validate(doc, checks.KUBE_VERSION, strict=True)
    job = _one(docs, "Job", f"{FULL}-profile")
    args = _profile_args(job)
    assert (args.command, args.model, args.device, args.quick, args.num_threads) == ("profile", "default", "cpu",
                                                                                     True, 2)
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    container = checks.main_container(job)
    assert container["securityContext"]["readOnlyRootFilesystem"] and container["securityContext"]["runAsNonRoot"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert args.out == mounts["profile"]["mountPath"] + "/profile.json" and not mounts["profile"].get("readOnly")
    claim = {v["name"]: v for v in pod["volumes"]}["profile"]["persistentVolumeClaim"]["claimName"]
    assert _one(docs, "PersistentVolumeClaim", claim)
    # the planner mounts the same claim read-only and reads the file the Job writes
    planner = _one(docs, "Deployment", f"{FULL}-planner")
    _, settings = checks.cli_settings(checks.main_container(planner))
    planner_volume = {v["name"]: v for v in planner["spec"]["template"]["spec"]["volumes"]}["profile"]
    assert planner_volume["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
    (mount,) = [m for m in checks.main_container(planner)["volumeMounts"] if m["name"] == "profile"]
    assert mount["readOnly"] and PlannerSettings.from_settings(settings).planner_profile == args.out
    assert args.out.startswith(mount["mountPath"] + "/")
    # nothing in or out of its pod
    policy = _one(docs, "NetworkPolicy", f"{FULL}-profile")
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert "ingress" not in policy["spec"] and "egress" not in policy["spec"]
    assert checks.pod_labels(job).items() >= policy["spec"]["podSelector"]["matchLabels"].items()


def test_the_profile_job_on_a_gpu_with_another_model_and_an_existing_claim(chart):
    values = {**ON, "model": {"source": "pvc", "path": "llama", "pvc": {"claimName": "models"}},
              "engine": {"dtype": "bfloat16"},
              "profile": {"enabled": True, "device": "cuda", "gpus": 1, "storage": {"existingClaim": "profiles"}}}
    chart.validate_schema(values)
    docs = _docs(chart, values)
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim" and "profile" in d["metadata"]["name"]]
    job = _one(docs, "Job", f"{FULL}-profile")
    args = _profile_args(job)
    assert (args.device, args.model, args.dtype) == ("cuda", "/models/llama", "bfloat16")
    container = checks.main_container(job)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert volumes["profile"]["persistentVolumeClaim"]["claimName"] == "profiles"
    assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "models"
    # profile.model measures another model than the workers'
    other = {**values, "profile": {**values["profile"], "model": "/models/other"}}
    assert _profile_args(_one(_docs(chart, other), "Job", f"{FULL}-profile")).model == "/models/other"


@pytest.mark.parametrize("bad", [{"device": "tpu"}, {"storage": {"accessModes": []}}, {"transferBackends": "ucx;rm"}])
def test_bad_profile_values_fail_the_schema(chart, bad):
    with pytest.raises(checks.helm.HelmValuesError):
        chart.validate_schema({"profile": {"enabled": True, **bad}})


def test_the_chart_with_the_profile_job_lints_strictly():
    report = checks.helm.lint(checks.CHART_DIR, PROFILED, strict=True, kube_version=f"v{checks.KUBE_VERSION}")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report

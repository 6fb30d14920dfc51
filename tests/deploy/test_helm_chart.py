"""The Helm chart (deploy/helm/pdserve), checked offline.

Rendered by Helm's own engine (helm-python-sdk: no cluster, no helm binary) for the defaults
and each profile under ci/, linted strictly, validated against the Kubernetes schemas of a
recent release (kubernetes-validate), and asserted on: the container args parse with the
real `pdserve` CLI parser; ports agree between Services, containers and probes; replicas,
GPUs, HPAs and PDBs follow the values; every pod is probed and runs as non-root; the
NetworkPolicy keeps the transfer ports to this release's pods; values that break the schema,
or combine badly, are rejected with a reason.
"""
from __future__ import annotations

import argparse
import base64
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from pdserve.deploy import cli
from pdserve.common import envs
from pdserve.kvtransfer.config import BACKENDS

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "deploy" / "helm" / "pdserve"
INVALID_VALUES = sorted((Path(__file__).parent / "invalid-values").glob("*.yaml"))
RELEASE = "pdserve-ci"
NAMESPACE = "llm"
# The newest Kubernetes release kubernetes-validate carries schemas for.
KUBE_VERSION = kubernetes_validate.latest_version()
# "default" is values.yaml alone; the others are the files under ci/.
PROFILES = ("default", "kind", "cpu-small", "gpu-2p4d", "external-redis")
ROLES = ("router", "prefill", "decode")
WORKERS = ("prefill", "decode")
SERVICE_MONITOR_API = "monitoring.coreos.com/v1/ServiceMonitor"
CUSTOM_METRICS_API = "custom.metrics.k8s.io/v1beta1"
RELEASE_LABELS = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": RELEASE}
# What the downward API puts in the variables the chart reads from it.
FIELD_VALUES = {"status.podIP": "10.42.0.7", "metadata.name": "pdserve-ci-decode-7d9f-abcde"}
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


# --- rendering ------------------------------------------------------------------------------

def profile_values(profile: str) -> dict[str, Any]:
    if profile == "default":
        return {}
    return yaml.safe_load((CHART_DIR / "ci" / f"{profile}.yaml").read_text()) or {}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes selector semantics: a LabelSelector, or a Service's plain label map."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        return all(labels.get(k) == v for k, v in selector.items())
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, values = expr["key"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": labels.get(key) not in values,
              "Exists": key in labels,
              "DoesNotExist": key not in labels}[expr["operator"]]
        if not ok:
            return False
    return True


@dataclass(frozen=True, slots=True)
class Manifests:
    """One render: the objects, NOTES.txt, and the merged values that produced them."""

    docs: tuple[dict[str, Any], ...]
    notes: str
    values: dict[str, Any]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def named(self, kind: str, name: str) -> dict[str, Any]:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
        return found[0]

    def workload(self, component: str) -> dict[str, Any]:
        """The Deployment of a component: router, prefill, decode or redis."""
        found = [d for d in self.of_kind("Deployment") if pod_labels(d).get("app.kubernetes.io/component") == component]
        assert len(found) == 1, f"expected one {component} Deployment, found {len(found)}"
        return found[0]

    def deployments_selected_by(self, selector: dict[str, Any]) -> list[dict[str, Any]]:
        return [d for d in self.of_kind("Deployment") if selects(selector, pod_labels(d))]


def render_raw(chart: helm.Chart, values: dict[str, Any], api_versions: tuple[str, ...]) -> dict[str, str]:
    options: dict[str, Any] = dict(name=RELEASE, namespace=NAMESPACE, is_install=True)
    capabilities = dict(kube_version=f"v{KUBE_VERSION}", api_versions=list(api_versions))
    if {"kube_version", "api_versions"} <= set(inspect.signature(chart.render).parameters):
        return chart.render(values, **options, **capabilities)
    # helm-python-sdk 0.2.2's Chart.render() does not forward kube_version/api_versions, which
    # its C entry point accepts and turns into .Capabilities: call that entry point directly.
    from helm_python import _native

    out = _native.call_string("helm_render", chart._raw(), json.dumps(values),
                              json.dumps({**options, **capabilities}))
    return json.loads(out)


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def render(chart: helm.Chart) -> Callable[..., Manifests]:
    """render(profile, api_versions=()) -> Manifests, cached per argument pair."""
    cache: dict[tuple[str, tuple[str, ...]], Manifests] = {}

    def _render(profile: str, api_versions: tuple[str, ...] = ()) -> Manifests:
        key = (profile, tuple(api_versions))
        if key not in cache:
            values = profile_values(profile)
            out = render_raw(chart, values, key[1])
            docs = tuple(d for path, text in sorted(out.items()) if path.endswith(".yaml")
                         for d in yaml.safe_load_all(text) if d)
            notes = next((text for path, text in out.items() if path.endswith("NOTES.txt")), "")
            cache[key] = Manifests(docs=docs, notes=notes, values=chart.merge_values(values))
        return cache[key]

    return _render


@pytest.fixture(scope="module")
def render_values(chart: helm.Chart) -> Callable[[dict[str, Any]], Manifests]:
    """render_values(overrides) -> Manifests of the default values with `overrides` merged in."""

    def _render(overrides: dict[str, Any]) -> Manifests:
        out = render_raw(chart, overrides, ())
        docs = tuple(d for path, text in sorted(out.items()) if path.endswith(".yaml")
                     for d in yaml.safe_load_all(text) if d)
        return Manifests(docs=docs, notes="", values=chart.merge_values(overrides))

    return _render


# --- reading pods ---------------------------------------------------------------------------

def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def main_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def container_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports") or []}


def probe_ports(container: dict[str, Any]) -> set[int]:
    """The ports the probes check: by grpc.health.v1, or by a TCP connect where the port asks
    for a client certificate (a worker's under internal mutual TLS)."""
    probes = [container[f"{kind}Probe"] for kind in ("startup", "readiness", "liveness")]
    return {(probe.get("grpc") or probe["tcpSocket"])["port"] for probe in probes}


def probe_kinds(container: dict[str, Any]) -> set[str]:
    return {next(k for k in ("grpc", "tcpSocket", "httpGet", "exec") if k in container[f"{kind}Probe"])
            for kind in ("startup", "readiness", "liveness")}


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The variables as the kubelet sets them; a Secret-backed one gets a placeholder naming
    the Secret."""
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        source = var.get("valueFrom", {})
        if "value" in var:
            env[var["name"]] = _VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), str(var["value"]))
        elif "fieldRef" in source:
            env[var["name"]] = FIELD_VALUES[source["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            placeholder = f"secret-{ref['name']}-{ref['key']}"
            env[var["name"]] = f"redis://{placeholder}:6379/0" if var["name"] == "PDSERVE_REDIS_URL" else placeholder
    return env


def expand_args(container: dict[str, Any]) -> list[str]:
    """command[1:] + args with $(VAR) expanded as Kubernetes does. An undefined variable fails
    here (Kubernetes would pass "$(VAR)" through literally)."""
    env = container_env(container)

    def sub(match: re.Match[str]) -> str:
        assert match.group(1) in env, f"args reference undefined variable {match.group(0)}"
        return env[match.group(1)]

    argv = list(container.get("command") or [])[1:] + list(container.get("args") or [])
    return [_VAR_REF.sub(sub, a) for a in argv]


def cli_settings(container: dict[str, Any]) -> tuple[argparse.Namespace, dict[str, Any]]:
    """Parse the container's command line with the real parser, then merge its PDSERVE_*
    variables as `pdserve` does at start-up."""
    assert container["command"] == ["pdserve"]
    namespace = cli.build_parser().parse_args(expand_args(container))
    environ = {k: v for k, v in container_env(container).items() if k.startswith(envs.ENV_PREFIX)}
    return namespace, cli.resolve(namespace, environ=environ)


def with_secret_files(docs, workload: dict[str, Any], settings: dict[str, Any], root: Path) -> dict[str, Any]:
    """`settings` as the pod's process sees them: each path that lies on one of its Secret
    volumes is remapped to a private file under `root` holding what the chart put in that
    Secret (or a stand-in, for a Secret the user brings); the enrollment token its init step
    writes is a stand-in."""
    import base64

    secrets = {d["metadata"]["name"]: d.get("data") or {} for d in docs if d.get("kind") == "Secret"}
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    out = dict(settings)
    for mount in main_container(workload).get("volumeMounts") or []:
        if mount["name"] == "enrollment":  # the pod's init step writes its enrollment token there
            for key, value in list(out.items()):
                if isinstance(value, str) and value.startswith(mount["mountPath"] + "/"):
                    local = root / "enrollment" / Path(value).name
                    local.parent.mkdir(parents=True, exist_ok=True)
                    local.write_text("e1 stand-in-token\n")
                    local.chmod(0o600)
                    out[key] = str(local)
        secret = volumes[mount["name"]].get("secret")
        for item in (secret or {}).get("items") or []:
            data = secrets.get(secret["secretName"], {}).get(item["key"])
            local = root / mount["name"] / item["path"]
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(base64.b64decode(data) if data else b"stand-in-key-9f2")
            local.chmod(0o600)
            out = {k: str(local) if v == f"{mount['mountPath']}/{item['path']}" else v for k, v in out.items()}
    return out


def admitting_rules(m: Manifests, labels: dict[str, str], port: int) -> list[dict[str, Any]]:
    """Ingress rules of every NetworkPolicy that selects these pod labels and covers the port."""
    def covers(rule: dict[str, Any]) -> bool:
        ports = rule.get("ports")
        return not ports or any(p["port"] == port or p["port"] <= port <= p.get("endPort", -1) for p in ports)

    return [rule for policy in m.of_kind("NetworkPolicy") if selects(policy["spec"]["podSelector"], labels)
            for rule in policy["spec"].get("ingress") or [] if covers(rule)]


def admits(rule: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a rule lets a pod with these labels (same namespace) in."""
    peers = rule.get("from")
    return not peers or any(set(p) == {"podSelector"} and selects(p["podSelector"], labels) for p in peers)


# --- lint and schemas -----------------------------------------------------------------------

@pytest.mark.parametrize("profile", PROFILES)
def test_chart_lints_strictly(profile: str) -> None:
    report = helm.lint(CHART_DIR, profile_values(profile), strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [msg for msg in report["messages"] if msg["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("profile", PROFILES)
def test_every_manifest_validates_against_the_kubernetes_schema(profile: str, render) -> None:
    unchecked = []
    for doc in render(profile, (SERVICE_MONITOR_API,)).docs:
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            unchecked.append(doc)
        except kubernetes_validate.ValidationError as err:
            where = ".".join(map(str, err.path))
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {where}: {err.message}")
    # Only the Prometheus Operator's CRD has no built-in schema: check its shape by hand.
    assert {d["kind"] for d in unchecked} <= {"ServiceMonitor"}
    for monitor in unchecked:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["spec"]["selector"]["matchLabels"]
        for endpoint in monitor["spec"]["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "authorization"}
            if "authorization" in endpoint:  # ServiceMonitor's SafeAuthorization: a Secret key, never a literal
                auth = endpoint["authorization"]
                assert auth["type"] == "Bearer" and set(auth["credentials"]) == {"name", "key"}
            assert re.fullmatch(r"\d+(ms|s|m|h)", endpoint["interval"])


@pytest.mark.parametrize("path", INVALID_VALUES, ids=lambda p: p.stem)
def test_values_that_break_the_schema_are_rejected(path: Path, chart: helm.Chart) -> None:
    expected = path.read_text().splitlines()[0].removeprefix("# expect:").strip()
    values = yaml.safe_load(path.read_text())
    with pytest.raises(helm.HelmValuesError) as schema_error:
        chart.validate_schema(values)
    assert expected in str(schema_error.value)
    with pytest.raises(helm.HelmValuesError):  # nothing renders either
        render_raw(chart, values, ())
    report = helm.lint(CHART_DIR, values, strict=True)
    assert any(expected in error for error in report["errors"]), report


@pytest.mark.parametrize("values, reason", [
    ({"redis": {"mode": "none"}}, "names redis but redis.mode is none"),
    ({"kvTransfer": {"backends": ["ucx", "disk"]}}, "names disk but kvTransfer.diskStore.enabled is false"),
    ({"metrics": {"port": 50100}}, "grpcPort, kvTransfer.port and metrics.port must differ"),
    ({"kvTransfer": {"port": 50150}}, "lies inside kvTransfer.ucx.tcpPortRange"),
    ({"router": {"grpcPort": 8000}}, "router.httpPort and router.grpcPort must differ"),
    ({"decode": {"autoscaling": {"enabled": True}, "resources": {"requests": {"cpu": None}}}},
     "needs decode.resources.requests.cpu"),
    ({"prefill": {"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2}}},
     "maxReplicas is below minReplicas"),
])
def test_inconsistent_values_fail_the_render_with_a_reason(values, reason: str, chart: helm.Chart) -> None:
    chart.validate_schema(values)  # each is well-typed: only the combination is wrong
    with pytest.raises(helm.HelmRenderError, match=re.escape(reason)):
        render_raw(chart, values, ())


def test_schema_choices_match_the_cli(chart: helm.Chart) -> None:
    (sub,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]

    def choices(role: str, dest: str) -> set[str]:
        (action,) = [a for a in sub.choices[role]._actions if a.dest == dest]
        return set(action.choices) | {""}  # "" keeps the CLI's default

    schema = chart.schema
    props = schema["properties"]
    for dest, key in (("dtype", "dtype"), ("quantization", "quantization"), ("capacity_policy", "capacityPolicy"),
                      ("chunking_policy", "chunkingPolicy")):
        assert set(props["engine"]["properties"][key]["enum"]) == choices("prefill", dest) == choices("decode", dest)
    assert set(props["decode"]["properties"]["failurePolicy"]["enum"]) == choices("decode", "failure_policy")
    policies = set(schema["$defs"]["policy"]["enum"])
    assert policies == choices("router", "prefill_policy") == choices("router", "decode_policy")
    assert set(props["kvTransfer"]["properties"]["backends"]["items"]["enum"]) == set(BACKENDS)
    assert set(props["kvTransfer"]["properties"]["prefixStore"]["enum"]) == \
        choices("prefill", "prefix_store") - {""} == choices("decode", "prefix_store") - {""}


def test_chart_defaults_are_the_cli_ports(chart: helm.Chart) -> None:
    v = chart.values
    assert (v["router"]["httpPort"], v["router"]["grpcPort"]) == (cli.ROUTER_HTTP_PORT, cli.ROUTER_GRPC_PORT)
    assert (v["prefill"]["grpcPort"], v["decode"]["grpcPort"]) == (cli.PREFILL_GRPC_PORT, cli.DECODE_GRPC_PORT)
    assert v["kvTransfer"]["port"] == cli.TRANSFER_PORT


# --- the roles' command lines ---------------------------------------------------------------

@pytest.mark.parametrize("profile", PROFILES)
def test_router_args_parse_with_the_cli_and_ports_agree(profile: str, render, tmp_path) -> None:
    m = render(profile)
    v = m.values["router"]
    container = main_container(m.workload("router"))
    namespace, s = cli_settings(container)
    assert namespace.command == "router" and s["host"] == m.values["listenHost"]
    assert container_ports(container) == {"http": s["http_port"], "grpc": s["grpc_port"],
                                          "registry": s["registry_port"]}
    assert (s["http_port"], s["grpc_port"], s["registry_port"]) == (v["httpPort"], v["grpcPort"], v["registryPort"])
    assert probe_ports(container) == {s["grpc_port"]}
    # the API key is a file from the Secret, never a flag or a variable
    assert "api_key" not in s and ("api_key_file" in s) == bool(v["apiKeySecret"]["name"])
    # The router's own config accepts what the chart passes (it imports no torch).
    from pdserve.router.config import RouterConfig

    config = RouterConfig.from_settings(with_secret_files(m.docs, m.workload("router"), s, tmp_path))
    assert config.metrics_token  # /metrics is never anonymous
    assert (config.host, config.http_port, config.grpc_port) == (m.values["listenHost"], v["httpPort"], v["grpcPort"])


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("role", WORKERS)
def test_worker_args_parse_with_the_cli_and_ports_agree(profile: str, role: str, render) -> None:
    m = render(profile)
    v = m.values
    container = main_container(m.workload(role))
    namespace, s = cli_settings(container)
    assert namespace.command == role
    assert container_ports(container) == {"grpc": s["grpc_port"], "transfer": s["transfer_port"],
                                          "metrics": s["metrics_port"]}
    assert (s["grpc_port"], s["transfer_port"], s["metrics_port"]) == \
        (v[role]["grpcPort"], v["kvTransfer"]["port"], v["metrics"]["port"])
    assert probe_ports(container) == {s["grpc_port"]}
    assert s["host"] == v["listenHost"] and s["advertise_host"] == FIELD_VALUES["status.podIP"]
    assert s["worker_id"] == FIELD_VALUES["metadata.name"]
    assert s["kv_backends"] == ",".join(v["kvTransfer"]["backends"])


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("role", WORKERS)
def test_workers_register_at_the_router_headless_service(profile: str, role: str, render) -> None:
    m = render(profile)
    _, s = cli_settings(main_container(m.workload(role)))
    host, _, port = s["router"].rpartition(":")
    headless = m.named("Service", host)
    # Headless and listing pods before they are ready: registration never waits on readiness.
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert m.deployments_selected_by(headless["spec"]["selector"]) == [m.workload("router")]
    assert [p["port"] for p in headless["spec"]["ports"]] == [int(port)] == [m.values["router"]["registryPort"]]


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("role", WORKERS)
def test_workers_get_their_model_and_stores(profile: str, role: str, render) -> None:
    m = render(profile)
    v = m.values
    container = main_container(m.workload(role))
    _, s = cli_settings(container)
    mounts = {vm["name"]: vm for vm in container["volumeMounts"]}
    volumes = {vol["name"]: vol for vol in m.workload(role)["spec"]["template"]["spec"]["volumes"]}

    if v["model"]["source"] == "image":
        assert s["model"] == v["model"]["path"] and "model" not in mounts
    else:
        assert mounts["model"]["readOnly"] is True
        assert s["model"] == f"{mounts['model']['mountPath']}/{v['model']['path']}"
        assert {"pvc": "persistentVolumeClaim", "hostPath": "hostPath"}[v["model"]["source"]] in volumes["model"]

    store = v["kvTransfer"]["diskStore"]
    if store["enabled"]:
        assert s["disk_store"] == mounts["kv-store"]["mountPath"]
        claim = volumes["kv-store"]["persistentVolumeClaim"]["claimName"]
        assert claim == store["existingClaim"] or m.named("PersistentVolumeClaim", claim)
    else:
        assert "disk_store" not in s and "kv-store" not in mounts

    redis = v["redis"]
    files = volumes.get("redis-key", {}).get("secret", {})
    if redis["mode"] == "internal":  # a URL without its password; the password a Secret's file
        assert "@" not in s["redis_url"] and s["redis_password_file"] == f"{mounts['redis-key']['mountPath']}/password"
        auth = redis["internal"]["auth"]["existingSecret"]
        assert files["secretName"] == (auth["name"] or f"{RELEASE}-redis-auth")
        assert files["items"] == [{"key": auth["key"], "path": "password"}]
        host, port = s["redis_url"].removeprefix("redis://").split("/")[0].split(":")
        service_port = m.named("Service", host)["spec"]["ports"][0]["port"]
        assert int(port) == service_port == container_ports(main_container(m.workload("redis")))["redis"]
    elif redis["mode"] == "external" and redis["external"]["existingSecret"]["name"]:
        assert "redis_url" not in s and s["redis_url_file"] == f"{mounts['redis-key']['mountPath']}/url"
        secret = redis["external"]["existingSecret"]
        assert files == {"secretName": secret["name"], "defaultMode": 0o440,
                         "items": [{"key": secret["key"], "path": "url"}]}
    elif redis["mode"] == "external":
        assert s["redis_url"] == redis["external"]["url"]
    else:
        assert "redis_url" not in s and "redis-key" not in mounts


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("role", WORKERS)
def test_an_init_container_prepares_the_workers_model_and_kernel_in_its_cache(profile: str, role: str,
                                                                               render, render_values) -> None:
    """`pdserve prepare` runs first with the worker's model and device, in the cache the
    worker then reads as a seed, mounted read-only (the serving process can plant nothing a
    later pod loads; its own builds go to its /tmp); `buildCache.prepare: false` leaves the
    init container out and the worker writes its cache itself."""
    m = render(profile)
    pod = m.workload(role)["spec"]["template"]["spec"]
    main = main_container(m.workload(role))
    (init,) = [c for c in pod["initContainers"] if c["name"] == "prepare"]
    argv = expand_args(init)
    assert argv[0] == "prepare" and init["image"] == main["image"]
    prepared = cli.build_parser().parse_args(argv)
    _, s = cli_settings(main)
    assert (prepared.model, prepared.device) == (s["model"], s.get("device", "cpu"))
    assert container_env(init)["PDSERVE_CACHE_ROOT"] == container_env(main)["PDSERVE_CACHE_SEED"]
    assert container_env(main)["PDSERVE_CACHE_ROOT"].startswith("/tmp/")
    mounts = lambda c: {vm["name"]: vm["mountPath"] for vm in c["volumeMounts"]}  # noqa: E731
    read_only = lambda c: {vm["name"]: vm.get("readOnly", False) for vm in c["volumeMounts"]}  # noqa: E731
    assert mounts(init)["cache"] == mounts(main)["cache"]
    assert read_only(main)["cache"] and not read_only(init)["cache"]
    assert mounts(init).get("model") == mounts(main).get("model")
    off_manifests = render_values({"buildCache": {"prepare": False}})
    off = off_manifests.workload(role)["spec"]["template"]["spec"]
    assert [c["name"] for c in off["initContainers"]] == ["enroll"]  # the enrollment step stays
    off_main = main_container(off_manifests.workload(role))
    assert not read_only(off_main)["cache"] and "PDSERVE_CACHE_SEED" not in container_env(off_main)


@pytest.mark.parametrize("profile", PROFILES)
def test_pdserve_variables_are_known_settings(profile: str, render) -> None:
    """A PDSERVE_* variable the CLI does not know would be ignored silently."""
    m = render(profile)
    for role in ROLES:
        container = main_container(m.workload(role))
        namespace = cli.build_parser().parse_args(expand_args(container))
        flags = {envs.ENV_PREFIX + key.upper() for key in vars(namespace)}
        unknown = [n for n in container_env(container) if n.startswith(envs.ENV_PREFIX)
                   and n not in flags and n not in envs.KNOWN]
        assert unknown == [], role


# --- services, pods, scaling ----------------------------------------------------------------

@pytest.mark.parametrize("profile", PROFILES)
def test_services_select_one_workload_and_its_ports(profile: str, render) -> None:
    m = render(profile)
    for service in m.of_kind("Service"):
        (deployment,) = m.deployments_selected_by(service["spec"]["selector"])
        ports = container_ports(main_container(deployment))
        for port in service["spec"]["ports"]:
            assert ports[port["targetPort"]] == port["port"], f"{service['metadata']['name']}:{port['name']}"


@pytest.mark.parametrize("profile", PROFILES)
def test_every_pod_is_probed_and_runs_as_non_root(profile: str, render) -> None:
    m = render(profile)
    components = {pod_labels(d)["app.kubernetes.io/component"] for d in m.of_kind("Deployment")}
    assert components == set(ROLES) | ({"redis"} if m.values["redis"]["mode"] == "internal" else set()) | (
        {"enroller"} if m.values["enrollment"]["enabled"] else set())
    for deployment in m.of_kind("Deployment"):
        pod, name = deployment["spec"]["template"]["spec"], deployment["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0, name
        # No API token (but the enroller's: TokenReview); no service-link variables (they would
        # collide with PDSERVE_*).
        calls_the_api = pod_labels(deployment)["app.kubernetes.io/component"] == "enroller"
        assert pod["automountServiceAccountToken"] is calls_the_api and pod["enableServiceLinks"] is False, name
        for container in pod["containers"]:
            assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(container), name
            sc = container["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False, name
            assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"], name
            writable = {vm["mountPath"] for vm in container["volumeMounts"] if not vm.get("readOnly")}
            assert writable & {"/tmp", "/data"}, f"{name}: read-only root and no scratch volume"
    for role in WORKERS:
        startup = main_container(m.workload(role))["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model loading is slow


@pytest.mark.parametrize("profile", PROFILES)
def test_replicas_and_gpus_follow_values(profile: str, render) -> None:
    m = render(profile)
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h["spec"] for h in m.of_kind("HorizontalPodAutoscaler")}
    for role in ROLES:
        cfg, deployment = m.values[role], m.workload(role)
        name = deployment["metadata"]["name"]
        if cfg["autoscaling"]["enabled"]:
            assert "replicas" not in deployment["spec"]  # the HPA owns the count
            assert (hpas[name]["minReplicas"], hpas[name]["maxReplicas"]) == \
                (cfg["autoscaling"]["minReplicas"], cfg["autoscaling"]["maxReplicas"])
        else:
            assert deployment["spec"]["replicas"] == cfg["replicas"] and name not in hpas
        limits = main_container(deployment)["resources"].get("limits", {})
        assert limits.get("nvidia.com/gpu", 0) == cfg.get("gpus", 0)
        if role in WORKERS:
            assert cli_settings(main_container(deployment))[1]["device"] == ("cuda" if cfg["gpus"] else "cpu")
    assert set(hpas) <= {d["metadata"]["name"] for d in m.of_kind("Deployment")}


def test_gpu_profile_runs_two_prefill_and_four_decode_gpu_pods(render) -> None:
    m = render("gpu-2p4d")
    hpas = {h["metadata"]["labels"]["app.kubernetes.io/component"]: h["spec"]
            for h in m.of_kind("HorizontalPodAutoscaler")}
    assert {role: (s["minReplicas"], s["maxReplicas"]) for role, s in hpas.items()} == \
        {"prefill": (2, 4), "decode": (4, 8)}
    for role in WORKERS:
        assert main_container(m.workload(role))["resources"]["limits"]["nvidia.com/gpu"] == 1
        tolerations = m.workload(role)["spec"]["template"]["spec"]["tolerations"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    assert m.workload("router")["spec"]["replicas"] == 2


def test_hpa_uses_a_custom_metric_only_where_an_adapter_serves_it(render) -> None:
    def metrics(api_versions: tuple[str, ...]) -> dict[str, list[dict[str, Any]]]:
        return {h["metadata"]["labels"]["app.kubernetes.io/component"]: h["spec"]["metrics"]
                for h in render("gpu-2p4d", api_versions).of_kind("HorizontalPodAutoscaler")}

    cpu = {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}
    assert metrics(()) == {"prefill": [cpu], "decode": [cpu]}
    with_adapter = metrics((CUSTOM_METRICS_API,))
    assert with_adapter["decode"] == [{"type": "Pods", "pods": {
        "metric": {"name": "pdserve_kv_cache_usage_ratio"},
        "target": {"type": "AverageValue", "averageValue": "0.8"}}}]
    assert with_adapter["prefill"][0]["pods"]["metric"]["name"] == "pdserve_prefill_queue_length"


@pytest.mark.parametrize("profile", PROFILES)
def test_disruption_budgets_follow_values(profile: str, render) -> None:
    m = render(profile)
    budgets = m.of_kind("PodDisruptionBudget")
    assert len(budgets) == sum(m.values[r]["pdb"]["enabled"] for r in ROLES)
    for role in ROLES:
        pdb = m.values[role]["pdb"]
        mine = [b["spec"] for b in budgets if m.deployments_selected_by(b["spec"]["selector"]) == [m.workload(role)]]
        assert len(mine) == int(pdb["enabled"]), role
        if mine and "minAvailable" in pdb:
            assert mine[0]["minAvailable"] == pdb["minAvailable"] and "maxUnavailable" not in mine[0]
        elif mine:
            assert mine[0]["maxUnavailable"] == pdb["maxUnavailable"]


def test_service_monitors_need_both_the_switch_and_the_crd(render) -> None:
    assert render("gpu-2p4d").of_kind("ServiceMonitor") == []
    assert "none was created" in render("gpu-2p4d").notes
    assert render("cpu-small", (SERVICE_MONITOR_API,)).of_kind("ServiceMonitor") == []
    m = render("gpu-2p4d", (SERVICE_MONITOR_API,))
    monitors = m.of_kind("ServiceMonitor")
    assert len(monitors) == 3 and "none was created" not in m.notes
    for monitor in monitors:
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        (endpoint,) = monitor["spec"]["endpoints"]
        services = [s for s in m.of_kind("Service") if selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
        assert len(services) == 1  # not the router's headless twin too: no double scrape
        assert endpoint["port"] in {p["name"] for p in services[0]["spec"]["ports"]}


# --- network policy -------------------------------------------------------------------------

@pytest.mark.parametrize("profile", PROFILES)
def test_network_policy_keeps_worker_ports_to_this_release(profile: str, render) -> None:
    m = render(profile)
    v = m.values
    low, high = map(int, v["kvTransfer"]["ucx"]["tcpPortRange"].split("-"))
    outsiders = ({"app": "something-else"},
                 {**RELEASE_LABELS, "app.kubernetes.io/instance": "other", "app.kubernetes.io/component": "decode"})
    for role in WORKERS:
        labels = pod_labels(m.workload(role))
        for port in (v["kvTransfer"]["port"], low, high, v[role]["grpcPort"]):
            rules = admitting_rules(m, labels, port)
            for rule in rules:
                assert rule.get("from"), f"{role}:{port} is open to everyone"
                for peer in rule["from"]:
                    assert set(peer) == {"podSelector"}, f"{role}:{port} admits {peer}"
                    assert RELEASE_LABELS.items() <= peer["podSelector"]["matchLabels"].items()
            for source in ROLES:
                assert any(admits(r, pod_labels(m.workload(source))) for r in rules), f"{source} -> {role}:{port}"
            assert not any(admits(r, outsider) for r in rules for outsider in outsiders)
        metrics_rules = admitting_rules(m, labels, v["metrics"]["port"])
        if v["networkPolicy"]["metricsFrom"]:
            assert any(r.get("from", []) == v["networkPolicy"]["metricsFrom"] for r in metrics_rules)
        assert all(r.get("from") for r in metrics_rules), "the metrics port is open to every pod"


@pytest.mark.parametrize("profile", PROFILES)
def test_network_policy_lets_clients_reach_only_the_router(profile: str, render) -> None:
    m = render(profile)
    v = m.values
    http_rules = admitting_rules(m, pod_labels(m.workload("router")), v["router"]["httpPort"])
    assert [r.get("from", []) for r in http_rules] == [v["networkPolicy"]["clientFrom"]]
    grpc_rules = admitting_rules(m, pod_labels(m.workload("router")), v["router"]["grpcPort"])
    assert [r.get("from", []) for r in grpc_rules] == [v["networkPolicy"]["clientFrom"]]
    # the registry: this release's worker pods only, never clients or the release's other pods
    registry_rules = admitting_rules(m, pod_labels(m.workload("router")), v["router"]["registryPort"])
    assert all(any(admits(r, pod_labels(m.workload(w))) for r in registry_rules) for w in WORKERS)
    assert all(r.get("from") for r in registry_rules)
    outsiders = ({"app": "something-else"}, pod_labels(m.workload("router")),
                 {**RELEASE_LABELS, "app.kubernetes.io/instance": "other", "app.kubernetes.io/component": "decode"})
    assert not any(admits(r, o) for r in registry_rules for o in outsiders)
    if v["redis"]["mode"] == "internal":
        redis_rules = admitting_rules(m, pod_labels(m.workload("redis")), v["redis"]["internal"]["port"])
        assert redis_rules and not any(admits(r, {"app": "something-else"}) for r in redis_rules)
        assert all(any(admits(r, pod_labels(m.workload(w))) for r in redis_rules) for w in WORKERS)


def test_notes_say_how_to_reach_the_router(render) -> None:
    notes = render("cpu-small").notes
    assert f"port-forward svc/{RELEASE}-router 8000:8000" in notes and "/v1/models" in notes
    notes = render("external-redis").notes
    assert "loadBalancer.ingress" in notes and "Authorization: Bearer" in notes



# --- the cluster secret ---------------------------------------------------------------------

@pytest.mark.parametrize("profile", PROFILES)
def test_every_role_reads_one_cluster_secret(profile: str, render) -> None:
    m = render(profile)
    secret = m.named("Secret", f"{RELEASE}-cluster-secret")
    key = m.values["clusterSecret"]["key"]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    import base64

    assert len(base64.b64decode(secret["data"][key])) >= 32
    for role in WORKERS:
        pod = m.workload(role)["spec"]["template"]["spec"]
        container = main_container(m.workload(role))
        _, s = cli_settings(container)
        mount = next(v for v in container["volumeMounts"] if v["name"] == "cluster-secret")
        volume = next(v for v in pod["volumes"] if v["name"] == "cluster-secret")
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
        assert s["cluster_secret_file"] == f"{mount['mountPath']}/{key}" and mount["readOnly"] is True
        assert "insecure_internal" not in s


@pytest.mark.parametrize("profile", PROFILES)
def test_the_router_reads_a_key_ring_its_init_container_derives_not_the_secret(profile: str, render,
                                                                                tmp_path) -> None:
    """Issue 48: the router loaded the master secret itself. Its container now mounts no
    cluster secret: an init container, the secret mounted in it alone, writes the router's key
    ring (call and block-hash keys) into a memory volume, which the router reads. Run here
    through the real CLI, the ring holds exactly those keys and derives no other."""
    from pdserve.deploy import cli as pdserve_cli
    from pdserve.security.secret import ROUTER_USES, ClusterSecret, ClusterSecretError, transfer_key

    m = render(profile)
    pod = m.workload("router")["spec"]["template"]["spec"]
    router = main_container(m.workload("router"))
    assert "cluster-secret" not in {v["name"] for v in router["volumeMounts"]}
    (init,) = pod["initContainers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["router-keys"]["emptyDir"]["medium"] == "Memory"
    ring_mount = next(v for v in router["volumeMounts"] if v["name"] == "router-keys")
    _, s = cli_settings(router)
    assert s["cluster_secret_file"].startswith(ring_mount["mountPath"] + "/") and ring_mount["readOnly"] is True
    assert {v["name"] for v in init["volumeMounts"]} >= {"cluster-secret", "router-keys"}
    args = init["args"]
    assert args[0] == "router-keys" and f"--out={s['cluster_secret_file']}" in args
    secret_file = tmp_path / "secret"
    secret = ClusterSecret.create(secret_file)
    ring = tmp_path / "ring"
    argv = [a.replace(a.partition("=")[2], str(secret_file)) if a.startswith("--cluster-secret-file=") else
            a.replace(s["cluster_secret_file"], str(ring)) for a in args]
    assert pdserve_cli.main(argv) == 0
    loaded = ClusterSecret.load(ring)
    assert all(loaded.key(use) == secret.key(use) for use in ROUTER_USES)
    with pytest.raises(ClusterSecretError, match="holds no"):
        transfer_key(loaded)


def test_an_existing_secret_replaces_the_generated_one(render_values) -> None:
    m = render_values({"clusterSecret": {"existingSecret": "mine", "key": "k"}})
    assert not [d for d in m.docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("cluster-secret")]
    for role in ROLES:
        volume = next(v for v in m.workload(role)["spec"]["template"]["spec"]["volumes"] if v["name"] == "cluster-secret")
        assert volume["secret"]["secretName"] == "mine" and volume["secret"]["items"] == [{"key": "k", "path": "k"}]


def test_router_tls_from_a_certificate_secret(render_values) -> None:
    m = render_values({"router": {"tls": {"secretName": "router-cert"}, "metricsAuth": True,
                                  "apiKeySecret": {"name": "api", "key": "key"}}})
    container = main_container(m.workload("router"))
    _, s = cli_settings(container)
    mount = next(v for v in container["volumeMounts"] if v["name"] == "tls")
    assert s["tls_cert"] == f"{mount['mountPath']}/tls.crt" and s["tls_key"] == f"{mount['mountPath']}/tls.key"
    assert "metrics_auth" not in s and s["metrics_token_file"]  # /metrics: the metrics token, always
    volume = next(v for v in m.workload("router")["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] == "router-cert"



def test_internal_mutual_tls_from_a_certificate_secret(render_values) -> None:
    m = render_values({"internalTLS": {"secretName": "internal-cert"}})
    assert not [d for d in m.of_kind("Secret") if d["metadata"]["name"].endswith("-internal-tls")]
    for role in ROLES:
        container = main_container(m.workload(role))
        _, s = cli_settings(container)
        mount = next(v for v in container["volumeMounts"] if v["name"] == "internal-tls")
        assert (s["internal_tls_cert"], s["internal_tls_key"], s["internal_tls_ca"]) == tuple(
            f"{mount['mountPath']}/{f}" for f in ("tls.crt", "tls.key", "ca.crt"))
        volume = next(v for v in m.workload(role)["spec"]["template"]["spec"]["volumes"] if v["name"] == "internal-tls")
        assert volume["secret"]["secretName"] == "internal-cert"


def _secret_files(m: Manifests, role: str, volume_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the container's mount, the pod's volume) of a Secret volume."""
    container = main_container(m.workload(role))
    mount = next(v for v in container["volumeMounts"] if v["name"] == volume_name)
    volume = next(v for v in m.workload(role)["spec"]["template"]["spec"]["volumes"] if v["name"] == volume_name)
    return mount, volume


@pytest.mark.parametrize("profile", PROFILES)
def test_internal_mutual_tls_is_on_by_default_with_certificates_made_for_the_release(profile: str, render) -> None:
    m = render(profile)
    secret = m.named("Secret", f"{RELEASE}-internal-tls")
    assert secret["type"] == "kubernetes.io/tls" and secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert set(secret["data"]) == {"ca.crt", "tls.crt", "tls.key"}
    for role in ROLES:
        container = main_container(m.workload(role))
        _, s = cli_settings(container)
        mount, volume = _secret_files(m, role, "internal-tls")
        assert mount["readOnly"] is True and volume["secret"]["secretName"] == secret["metadata"]["name"]
        assert (s["internal_tls_cert"], s["internal_tls_key"], s["internal_tls_ca"]) == tuple(
            f"{mount['mountPath']}/{f}" for f in ("tls.crt", "tls.key", "ca.crt"))
        # the kubelet holds no certificate: a worker's mutual-TLS port is probed by connecting
        assert probe_kinds(container) == ({"grpc"} if role == "router" else {"tcpSocket"})
        assert probe_ports(container) == {s["grpc_port"]}


def test_the_release_certificates_carry_the_services_names_and_serve_mutual_tls(render) -> None:
    """The chart's CA signed the certificate, which names pdserve-internal (what every
    internal client checks) and the Services; a real gRPC server with it admits a client
    presenting it and refuses one presenting none."""
    import base64
    from concurrent import futures

    import grpc
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from pdserve.rpc.credentials import INTERNAL_SERVER_NAME

    data = {k: base64.b64decode(v) for k, v in render("default").named("Secret", f"{RELEASE}-internal-tls")["data"].items()}
    ca, cert = x509.load_pem_x509_certificate(data["ca.crt"]), x509.load_pem_x509_certificate(data["tls.crt"])
    key = serialization.load_pem_private_key(data["tls.key"], password=None)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    cert.verify_directly_issued_by(ca)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()
    names = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName))
    assert {INTERNAL_SERVER_NAME, f"{RELEASE}-router-headless.{NAMESPACE}.svc", f"{RELEASE}-decode.{NAMESPACE}.svc",
            f"{RELEASE}-prefill", f"{RELEASE}-router.{NAMESPACE}"} <= names
    usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= usages

    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(data["tls.key"], data["tls.crt"])], root_certificates=data["ca.crt"], require_client_auth=True))
    server.start()
    options = [("grpc.ssl_target_name_override", INTERNAL_SERVER_NAME)]
    try:
        ours = grpc.ssl_channel_credentials(data["ca.crt"], data["tls.key"], data["tls.crt"])
        with grpc.secure_channel(f"127.0.0.1:{port}", ours, options) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        anonymous = grpc.ssl_channel_credentials(data["ca.crt"])
        with grpc.secure_channel(f"127.0.0.1:{port}", anonymous, options) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_internal_mutual_tls_can_be_turned_off(render_values) -> None:
    m = render_values({"internalTLS": {"enabled": False}})
    assert not [d for d in m.of_kind("Secret") if d["metadata"]["name"].endswith("-internal-tls")]
    for role in ROLES:
        container = main_container(m.workload(role))
        _, s = cli_settings(container)
        assert "internal_tls_cert" not in s and "internal-tls" not in {v["name"] for v in container["volumeMounts"]}
        assert probe_kinds(container) == {"grpc"}


def test_the_admin_key_is_mounted_from_its_secret(render_values, tmp_path) -> None:
    m = render_values({"router": {"apiKeySecret": {"name": "api", "key": "key"},
                                  "adminKeySecret": {"name": "ops", "key": "admin"}}})
    _, s = cli_settings(main_container(m.workload("router")))
    mount, volume = _secret_files(m, "router", "admin-key")
    assert s["admin_api_key_file"] == f"{mount['mountPath']}/admin" and mount["readOnly"] is True
    assert volume["secret"]["secretName"] == "ops" and volume["secret"]["items"] == [{"key": "admin", "path": "admin"}]
    from pdserve.router.config import RouterConfig

    config = RouterConfig.from_settings(with_secret_files(m.docs, m.workload("router"), s, tmp_path))
    assert config.admin_api_key_file.endswith("/admin-key/admin") and config.api_key == "stand-in-key-9f2"
    default = render_values({})
    assert "admin_api_key_file" not in cli_settings(main_container(default.workload("router")))[1]


# --- scheduling on a small cluster ----------------------------------------------------------

def _quantity(text: str | int | float) -> float:
    """A Kubernetes quantity (CPU or bytes) as a float: "500m" -> 0.5, "1536Mi" -> 1536 * 2**20."""
    text = str(text)
    binary = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    decimal = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    for suffix, factor in {**binary, **decimal}.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def test_kind_values_fit_one_two_cpu_eight_gib_node(render) -> None:
    m = render("kind")
    cpu = memory = 0.0
    for workload in m.of_kind("Deployment") + m.of_kind("StatefulSet"):
        pod = workload["spec"]["template"]["spec"]
        replicas = workload["spec"].get("replicas", 1)
        # What the scheduler reserves for a pod: its containers' requests summed, or its
        # largest init container's (init containers run one at a time, before the rest).
        pod_cpu = pod_memory = 0.0
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            requests = container.get("resources", {}).get("requests", {})
            assert "cpu" in requests and "memory" in requests, container["name"]
        for group, combine in (("containers", sum), ("initContainers", max)):
            requests = [c["resources"]["requests"] for c in pod.get(group, [])]
            if requests:
                pod_cpu = max(pod_cpu, combine(_quantity(r["cpu"]) for r in requests))
                pod_memory = max(pod_memory, combine(_quantity(r["memory"]) for r in requests))
        cpu += replicas * pod_cpu
        memory += replicas * pod_memory
    # kind's own pods (kube-apiserver, etcd, coredns, ...) request about 0.95 CPU together.
    assert cpu <= 2 - 0.95, cpu
    assert memory <= 6 * 2**30, memory
    assert m.of_kind("PersistentVolumeClaim") == []


@pytest.mark.parametrize("profile", ["default", "kind"])
def test_no_read_write_many_claim_unless_asked(profile: str, render) -> None:
    claims = render(profile).of_kind("PersistentVolumeClaim")
    assert not any("ReadWriteMany" in c["spec"]["accessModes"] for c in claims)


# --- issue 25: secrets off the command line, Redis behind a password, egress, metrics ------------

def all_containers(m: Manifests) -> Iterator[tuple[str, dict[str, Any]]]:
    for d in m.of_kind("Deployment"):
        spec = d["spec"]["template"]["spec"]
        for c in [*(spec.get("initContainers") or []), *spec["containers"]]:
            yield d["metadata"]["name"], c


@pytest.mark.parametrize("profile", PROFILES)
def test_no_redis_url_or_password_on_any_command_line(profile: str, render) -> None:
    m = render(profile)
    for name, container in all_containers(m):
        argv = " ".join([*(container.get("command") or []), *(container.get("args") or [])])
        argv = argv.replace("--redis-url-file=", "--file=")  # a path, not the URL
        assert "redis://" not in argv and "--redis-url" not in argv and "requirepass " not in argv.replace(
            "printf 'requirepass %s", ""), f"{name}/{container['name']}: {argv}"
        for var in container.get("env") or []:  # issue 48: keys are files, never variables
            assert "PASSWORD" not in var["name"] and "AUTH" not in var["name"], var
            assert "secretKeyRef" not in var.get("valueFrom", {}) or name.endswith("-planner"), var


def test_the_internal_redis_asks_for_a_password_from_a_secret(render, render_values, tmp_path) -> None:
    m = render("default")
    redis = main_container(m.workload("redis"))
    args = redis["args"]
    assert args[args.index("--protected-mode") + 1] == "yes"
    script = redis["command"][2]
    assert redis["command"][:2] == ["sh", "-c"] and "requirepass" in script and "/run/redis/" in script
    assert '"$(cat /etc/redis-auth/password)"' in script and "env" not in redis  # a file, not a variable
    assert script.rstrip().endswith('exec redis-server /run/redis/auth.conf "$@"')
    assert "cat /etc/redis-auth/password" in redis["readinessProbe"]["exec"]["command"][2]
    volumes = {v["name"]: v for v in m.workload("redis")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["run"]["emptyDir"]["medium"] == "Memory"
    secret = m.named("Secret", f"{RELEASE}-redis-auth")
    assert volumes["auth"]["secret"] == {"secretName": f"{RELEASE}-redis-auth", "defaultMode": 0o440,
                                         "items": [{"key": "password", "path": "password"}]}
    assert len(secret["data"]["password"]) >= 40 and secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    from pdserve.worker.settings import WorkerSettings

    for role in WORKERS:  # the workers' URL carries the same Secret's password, read from its file
        _, s = cli_settings(main_container(m.workload(role)))
        settings = WorkerSettings.from_settings(role, with_secret_files(m.docs, m.workload(role), s, tmp_path / role))
        password = base64.b64decode(secret["data"]["password"]).decode()
        assert settings.redis_url == f"redis://:{password}@{RELEASE}-redis:6379/0"
    own = render_values({"redis": {"internal": {"auth": {"existingSecret": {"name": "mine", "key": "pw"}}}}})
    assert not [s for s in own.of_kind("Secret") if s["metadata"]["name"].endswith("-redis-auth")]
    assert {v["name"]: v for v in own.workload("redis")["spec"]["template"]["spec"]["volumes"]}["auth"]["secret"][
        "secretName"] == "mine"


@pytest.mark.parametrize("profile", PROFILES)
def test_egress_reaches_only_this_release_dns_and_egress_to(profile: str, render) -> None:
    m = render(profile)
    policies = [p for p in m.of_kind("NetworkPolicy") if "Egress" in p["spec"]["policyTypes"]]
    for component in (*ROLES, *(["redis"] if m.values["redis"]["mode"] == "internal" else [])):
        labels = pod_labels(m.workload(component))
        mine = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
        assert mine, f"{component} has no egress policy"
        rules = [r for p in mine for r in p["spec"].get("egress") or []]
        if component == "redis":
            assert rules == []
            continue
        allowed = [{"podSelector": {"matchLabels": RELEASE_LABELS}}, *m.values["networkPolicy"]["egressTo"]]
        for rule in rules:
            assert rule.get("to"), f"{component}: an egress rule open to everywhere"
            for peer in rule["to"]:
                dns = peer == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                               "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}  # not any pod so labelled
                assert peer in allowed or (dns and {p["port"] for p in rule["ports"]} == {53}), peer


def test_metrics_from_no_longer_admits_every_pod(render, render_values) -> None:
    m = render("default")
    for role in WORKERS:
        rules = admitting_rules(m, pod_labels(m.workload(role)), m.values["metrics"]["port"])
        assert rules and all(r.get("from") for r in rules)
        assert not any(admits(r, {"app": "something-else"}) for r in rules)
        for rule in rules:  # a pod that labels itself prometheus in any namespace is not enough
            for peer in rule["from"]:
                assert peer.get("namespaceSelector") in (None, {"matchLabels": {
                    "kubernetes.io/metadata.name": "monitoring"}}), peer
    closed = render_values({"networkPolicy": {"metricsFrom": []}})
    for role in WORKERS:
        labels = pod_labels(closed.workload(role))
        rules = admitting_rules(closed, labels, closed.values["metrics"]["port"])
        assert all(r.get("from") for r in rules) and not any(admits(r, {"app": "something-else"}) for r in rules)


def test_a_metrics_token_secret_reaches_every_pod_and_service_monitor(chart) -> None:
    """Issue 48, item 7: every /metrics, the router's included (it names workers and their
    prefix-cache hits), asks for the metrics token, a file from its Secret; every
    ServiceMonitor sends it."""
    values = {"metrics": {"tokenSecret": {"name": "scrape", "key": "token"}, "serviceMonitor": {"enabled": True}},
              "router": {"metricsAuth": False}}
    out = render_raw(chart, values, (SERVICE_MONITOR_API,))
    docs = [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    m = Manifests(docs=tuple(docs), notes="", values=chart.merge_values(values))
    for role in ROLES:
        _, s = cli_settings(main_container(m.workload(role)))
        mount, volume = _secret_files(m, role, "metrics-token")
        assert s["metrics_token_file"] == f"{mount['mountPath']}/token" and mount["readOnly"] is True
        assert volume["secret"]["secretName"] == "scrape" and volume["secret"]["items"] == [{"key": "token", "path": "token"}]
        assert "PDSERVE_METRICS_TOKEN" not in container_env(main_container(m.workload(role)))
    monitors = m.of_kind("ServiceMonitor")
    assert len(monitors) == 3
    for monitor in monitors:
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "scrape", "key": "token"}}


def test_worker_metrics_ask_for_a_token_by_default_and_the_notes_warn_without_an_api_key(render) -> None:
    """Defaults: the chart makes the metrics token (kept across upgrades) and every pod asks
    for it; with no API key, NOTES.txt says anyone who reaches the router may use it."""
    m = render("default")
    assert not m.values["metrics"]["tokenSecret"]["name"]
    (token,) = [d for d in m.of_kind("Secret") if d["metadata"]["name"].endswith("-metrics-token")]
    assert token["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    for role in ROLES:
        _, volume = _secret_files(m, role, "metrics-token")
        assert volume["secret"]["secretName"] == token["metadata"]["name"]
        assert volume["secret"]["items"] == [{"key": m.values["metrics"]["tokenSecret"]["key"], "path": "token"}]
    if not m.values["router"]["apiKeySecret"]["name"]:
        assert "WARNING: no API key" in m.notes


def test_speculative_config_reaches_the_decode_engine(render_values, tmp_path) -> None:
    """engine.speculativeConfig, a map, is the workers' --speculative-config JSON; unset, off."""
    from pdserve.worker.settings import WorkerSettings

    m = render_values({"engine": {"speculativeConfig": {"method": "ngram", "num_speculative_tokens": 4,
                                                        "prompt_lookup_max": 3}}})
    _, s = cli_settings(main_container(m.workload("decode")))
    s = with_secret_files(m.docs, m.workload("decode"), s, tmp_path)
    spec = WorkerSettings.from_settings("decode", s).engine_config().speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 4, 3)
    plain = render_values({})
    _, s = cli_settings(main_container(plain.workload("decode")))
    s = with_secret_files(plain.docs, plain.workload("decode"), s, tmp_path)
    assert WorkerSettings.from_settings("decode", s).engine_config().speculative is None

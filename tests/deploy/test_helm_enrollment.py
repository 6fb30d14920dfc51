"""The chart's enrollment (issue 48, "Enrollment of one's own"), checked offline: the enroller
Deployment runs `pdserve enroller` (args parsed by the real CLI) with the key Secret's private
half, which no other pod mounts; its RBAC is TokenReview create and pod get, nothing else; the
ServiceAccounts it maps to roles are the ones the worker pods run as, and the release labels it
checks are theirs; each worker pod's init container shows a projected token of the enroller's
audience, mounted in that container alone, and writes the token file the worker reads; the
router mounts only the public half, and that half verifies what the private half issues; only
worker pods may reach the enroller. The rendering helpers are test_helm_chart's own."""
from __future__ import annotations

import base64
import importlib.util
import sys
from pathlib import Path

import pytest

from pdserve.deploy import cli
from pdserve.router.config import RouterConfig
from pdserve.router.enrollment import enrollment_verifier
from pdserve.security.enrollment import EnrollmentIssuer, load_public_key

_spec = importlib.util.spec_from_file_location("helm_chart_checks", Path(__file__).with_name("test_helm_chart.py"))
checks = sys.modules.setdefault("helm_chart_checks", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(checks)

FULL = checks.RELEASE
KEY_SECRET = f"{FULL}-enrollment-key"


@pytest.fixture(scope="module")
def chart():
    with checks.helm.Chart.load(checks.CHART_DIR) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def m(chart):
    return _render(chart, {"enrollment": {"revokedWorkers": ["pdserve-ci-decode-5c7-old"]}})


def _render(chart, values) -> "checks.Manifests":
    import yaml

    chart.validate_schema(values)
    out = checks.render_raw(chart, values, ())
    docs = tuple(d for path, text in sorted(out.items()) if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d)
    return checks.Manifests(docs=docs, notes="", values=chart.merge_values(values))


def _pod(m, component: str) -> dict:
    return m.workload(component)["spec"]["template"]["spec"]


def _secret_items(pod: dict, secret: str) -> set[str]:
    return {item["key"] for v in pod["volumes"] if (v.get("secret") or {}).get("secretName") == secret
            for item in v["secret"].get("items") or [{"key": "*"}]}


def test_every_manifest_validates_and_the_enrollers_rbac_is_narrow(m) -> None:
    for doc in m.docs:
        checks.kubernetes_validate.validate(doc, checks.KUBE_VERSION, strict=True)
    name = f"{checks.NAMESPACE}-{FULL}-enroller"
    assert m.named("ClusterRole", name)["rules"] == [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]}]
    assert m.named("Role", f"{FULL}-enroller")["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]
    for kind, role_kind, ref in (("ClusterRoleBinding", "ClusterRole", name), ("RoleBinding", "Role", f"{FULL}-enroller")):
        binding = [d for d in m.of_kind(kind) if d["roleRef"]["name"] == ref]
        assert len(binding) == 1 and binding[0]["roleRef"]["kind"] == role_kind
        assert binding[0]["subjects"] == [{"kind": "ServiceAccount", "name": f"{FULL}-enroller",
                                           "namespace": checks.NAMESPACE}]
    pod = _pod(m, "enroller")
    assert pod["serviceAccountName"] == f"{FULL}-enroller" and pod["automountServiceAccountToken"] is True
    service = m.named("Service", f"{FULL}-enroller")
    container = checks.main_container(m.workload("enroller"))
    assert service["spec"]["ports"][0]["port"] == checks.container_ports(container)["http"]
    assert checks.selects(service["spec"]["selector"], checks.pod_labels(m.workload("enroller")))


def test_the_enroller_maps_the_workers_own_service_accounts_and_labels(m) -> None:
    container = checks.main_container(m.workload("enroller"))
    args = cli.build_parser().parse_args(checks.expand_args(container))
    assert args.command == "enroller" and args.namespace == checks.NAMESPACE
    accounts = dict(item.split("=", 1) for item in args.role_account)
    labels = dict(item.split("=", 1) for item in args.release_label)
    assert args.port == m.values["enrollment"]["port"] and args.host == m.values["listenHost"]
    for role in checks.WORKERS:
        pod = _pod(m, role)
        assert pod["serviceAccountName"] == accounts[role] == f"{FULL}-{role}"
        account = m.named("ServiceAccount", accounts[role])
        assert account["automountServiceAccountToken"] is False and pod["automountServiceAccountToken"] is False
        pod_labels = checks.pod_labels(m.workload(role))
        assert labels.items() <= pod_labels.items() and pod_labels["app.kubernetes.io/component"] == role
    mount = next(vm for vm in container["volumeMounts"] if vm["name"] == "enrollment-key")
    assert args.enrollment_key_file == f"{mount['mountPath']}/private.pem" and mount["readOnly"]
    tls = next(vm for vm in container["volumeMounts"] if vm["name"] == "internal-tls")["mountPath"]
    assert (args.tls_cert, args.tls_key) == (f"{tls}/tls.crt", f"{tls}/tls.key")
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"


def test_a_worker_fetches_its_token_with_a_projected_token_only_its_init_step_sees(m) -> None:
    enroller = m.named("Service", f"{FULL}-enroller")
    for role in checks.WORKERS:
        pod = _pod(m, role)
        init = pod["initContainers"][0]
        assert init["name"] == "enroll"
        args = cli.build_parser().parse_args(checks.expand_args(init))
        # HTTPS under internal TLS (on by default): checked against its CA and the internal name
        assert args.enroller_url == f"https://{FULL}-enroller:{enroller['spec']['ports'][0]['port']}"
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {vm["name"]: vm for vm in init["volumeMounts"]}
        assert args.ca_file == f"{mounts['internal-tls']['mountPath']}/ca.crt"
        assert args.server_name == "pdserve-internal"
        (source,) = volumes["enroll-sa-token"]["projected"]["sources"]
        assert source["serviceAccountToken"]["audience"] == m.values["enrollment"]["audience"]
        assert 600 <= source["serviceAccountToken"]["expirationSeconds"] <= 3600
        assert args.service_account_token_file == f"{mounts['enroll-sa-token']['mountPath']}/token"
        others = [c for c in pod["containers"] + pod["initContainers"][1:]
                  if any(vm["name"] == "enroll-sa-token" for vm in c.get("volumeMounts") or [])]
        assert others == []  # the worker itself never holds a token the API server accepts
        assert volumes["enrollment"]["emptyDir"]["medium"] == "Memory"
        _, settings = checks.cli_settings(checks.main_container(m.workload(role)))
        main_mounts = {vm["name"]: vm for vm in checks.main_container(m.workload(role))["volumeMounts"]}
        assert main_mounts["enrollment"]["readOnly"] and "enroll-sa-token" not in main_mounts
        assert settings["enrollment_token_file"] == args.out
        assert args.out.startswith(mounts["enrollment"]["mountPath"] + "/")


def test_the_router_holds_the_public_half_which_verifies_what_the_enroller_issues(m, tmp_path) -> None:
    router = m.workload("router")
    _, settings = checks.cli_settings(checks.main_container(router))
    assert _secret_items(router["spec"]["template"]["spec"], KEY_SECRET) == {"public.pem"}
    for component in ("prefill", "decode", "router"):
        assert "private.pem" not in _secret_items(_pod(m, component), KEY_SECRET), component
    assert _secret_items(_pod(m, "enroller"), KEY_SECRET) == {"private.pem"}
    data = m.named("Secret", KEY_SECRET)["data"]
    private = tmp_path / "private.pem"
    private.write_bytes(base64.b64decode(data["private.pem"]))
    private.chmod(0o600)
    issuer = EnrollmentIssuer.load(str(private))
    assert load_public_key(base64.b64decode(data["public.pem"]).decode()) == issuer.public_key
    config = RouterConfig.from_settings(checks.with_secret_files(m.docs, router, settings, tmp_path / "router"))
    verifier = enrollment_verifier(config)
    verifier.check(issuer.issue(f"{FULL}-decode-7d9f-abcde", "decode", "10.42.0.7"), f"{FULL}-decode-7d9f-abcde",
                   "decode", "10.42.0.7:50070")
    # the revoked list: a ConfigMap the router reads the file of
    volume = next(v for v in router["spec"]["template"]["spec"]["volumes"] if v["name"] == "revoked-workers")
    revoked = m.named("ConfigMap", volume["configMap"]["name"])["data"]["revoked-workers"]
    mount = next(vm for vm in checks.main_container(router)["volumeMounts"] if vm["name"] == "revoked-workers")
    assert settings["revoked_workers_file"] == f"{mount['mountPath']}/revoked-workers"
    assert [line.strip() for line in revoked.splitlines() if not line.startswith("#")] == ["pdserve-ci-decode-5c7-old"]


def test_only_worker_pods_reach_the_enroller(m) -> None:
    labels = checks.pod_labels(m.workload("enroller"))
    rules = checks.admitting_rules(m, labels, m.values["enrollment"]["port"])
    assert rules
    for component in ("prefill", "decode"):
        assert any(checks.admits(r, checks.pod_labels(m.workload(component))) for r in rules), component
    for component in ("router", "redis"):
        assert not any(checks.admits(r, checks.pod_labels(m.workload(component))) for r in rules), component
    assert not any(checks.admits(r, {"app": "elsewhere"}) for r in rules)


def test_off_and_bring_your_own_key(chart) -> None:
    off = _render(chart, {"enrollment": {"enabled": False}})
    assert not [d for d in off.docs if "enroll" in d["metadata"]["name"] or d["kind"] in ("ClusterRole", "Role")]
    for role in checks.WORKERS:
        assert [c["name"] for c in _pod(off, role)["initContainers"]] == ["prepare"]
        assert "enrollment_token_file" not in checks.cli_settings(checks.main_container(off.workload(role)))[1]
    assert "enrollment_public_key_file" not in checks.cli_settings(checks.main_container(off.workload("router")))[1]
    plain = _render(chart, {"internalTLS": {"enabled": False}})
    args = cli.build_parser().parse_args(checks.expand_args(_pod(plain, "decode")["initContainers"][0]))
    assert args.enroller_url.startswith("http://") and not args.ca_file
    enroller = cli.build_parser().parse_args(checks.expand_args(checks.main_container(plain.workload("enroller"))))
    assert not enroller.tls_cert
    own = _render(chart, {"enrollment": {"keySecret": "my-enrollment-key"}})
    assert not [d for d in own.docs if d["kind"] == "Secret" and d["metadata"]["name"] == KEY_SECRET]
    assert _secret_items(_pod(own, "enroller"), "my-enrollment-key") == {"private.pem"}
    assert _secret_items(_pod(own, "router"), "my-enrollment-key") == {"public.pem"}


def test_the_chart_defaults_are_the_clis(chart) -> None:
    """One default per setting: the chart's enrollment values equal the commands' own."""
    values = chart.merge_values({})["enrollment"]
    enroller = cli.build_parser().parse_args(["enroller", "--enrollment-key-file", "k", "--namespace", "n"])
    enroll = cli.build_parser().parse_args(["enroll", "--enroller-url", "u", "--service-account-token-file", "t",
                                            "--out", "o"])
    assert (values["port"], values["audience"], values["rate"], values["burst"]) == (
        enroller.port, enroller.audience, enroller.rate, enroller.burst)
    assert values["initTimeoutS"] == enroll.timeout_s

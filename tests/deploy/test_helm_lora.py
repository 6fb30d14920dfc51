"""The chart's LoRA adapters: off by default; on, every prefill and decode worker gets the
LoRA flags (parsed by the real CLI into the worker's typed LoRA settings, each module's path
under the adapters' mount, which is the allowed root), the adapters' volume read-only (a PVC,
a host path, or an emptyDir an init step fills), and the router its admin endpoints; every
manifest validates and lints. The rendering helpers are test_helm_chart's own."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from pdserve.worker.lora import LoraModule
from pdserve.worker.settings import WorkerSettings

_spec = importlib.util.spec_from_file_location("helm_chart_checks", Path(__file__).with_name("test_helm_chart.py"))
checks = sys.modules.setdefault("helm_chart_checks", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(checks)

MODULES = [{"name": "sql", "path": "sql"}, {"name": "chat/v2", "path": "/chat", "baseModelName": "SmolLM2"}]
ON = {"lora": {"enabled": True, "source": "pvc", "pvc": {"claimName": "adapters"}, "maxLoras": 2,
               "maxLoraRank": 8, "modules": MODULES}}
INIT = {"lora": {"enabled": True, "source": "init", "init": {"command": ["sh", "-c", "cp -r /seed/. $PDSERVE_LORA_DIR"]},
                 "modules": MODULES[:1]}}


@pytest.fixture(scope="module")
def chart():
    with checks.helm.Chart.load(checks.CHART_DIR) as loaded:
        yield loaded


def _render(chart, values) -> checks.Manifests:
    import yaml

    out = checks.render_raw(chart, values, ())
    docs = tuple(d for path, text in sorted(out.items()) if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d)
    return checks.Manifests(docs=docs, notes="", values=chart.merge_values(values))


def _worker_settings(manifests, role: str) -> WorkerSettings:
    import tempfile

    _, merged = checks.cli_settings(checks.main_container(manifests.workload(role)))
    with tempfile.TemporaryDirectory() as root:  # the pod's Secret files (metrics token, Redis password)
        merged = checks.with_secret_files(manifests.docs, manifests.workload(role), merged, Path(root))
        return WorkerSettings.from_settings(role, merged)


def test_off_by_default(chart):
    manifests = _render(chart, {})
    for role in checks.WORKERS:
        assert not _worker_settings(manifests, role).lora().enabled
        volumes = manifests.workload(role)["spec"]["template"]["spec"]["volumes"]
        assert "lora-adapters" not in {v["name"] for v in volumes}
    assert "--enable-lora" not in checks.main_container(manifests.workload("router"))["args"]


def test_workers_serve_the_listed_adapters_from_a_read_only_volume(chart):
    manifests = _render(chart, ON)
    for role in checks.WORKERS:
        lora = _worker_settings(manifests, role).lora()
        assert lora.enabled and (lora.max_loras, lora.max_lora_rank) == (2, 8)
        assert lora.allowed_root == "/adapters"
        assert lora.modules == (LoraModule("sql", "/adapters/sql"), LoraModule("chat/v2", "/adapters/chat", "SmolLM2"))
        pod = manifests.workload(role)["spec"]["template"]["spec"]
        mount = next(m for m in checks.main_container(manifests.workload(role))["volumeMounts"]
                     if m["name"] == "lora-adapters")
        assert mount == {"name": "lora-adapters", "mountPath": "/adapters", "readOnly": True}
        volume = next(v for v in pod["volumes"] if v["name"] == "lora-adapters")
        assert volume["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
    router, merged = checks.cli_settings(checks.main_container(manifests.workload("router")))
    assert merged["enable_lora"] is True
    for doc in manifests.docs:
        checks.kubernetes_validate.validate(doc, checks.KUBE_VERSION, strict=True)
    report = checks.helm.lint(checks.CHART_DIR, ON, strict=True)
    assert not report["errors"], report


def test_an_init_step_can_write_the_adapters_first(chart):
    manifests = _render(chart, INIT)
    for role in checks.WORKERS:
        pod = manifests.workload(role)["spec"]["template"]["spec"]
        init = {c["name"]: c for c in pod["initContainers"]}
        assert list(init) == ["enroll", "lora-adapters", "prepare"]  # the token, the adapters, the build cache
        step = init["lora-adapters"]
        assert step["command"] == INIT["lora"]["init"]["command"]
        assert {"name": "PDSERVE_LORA_DIR", "value": "/adapters"} in step["env"]
        assert {"name": "lora-adapters", "mountPath": "/adapters"} in step["volumeMounts"]
        volume = next(v for v in pod["volumes"] if v["name"] == "lora-adapters")
        assert "emptyDir" in volume
        assert _worker_settings(manifests, role).lora().modules == (LoraModule("sql", "/adapters/sql"),)
    no_prepare = _render(chart, {**INIT, "buildCache": {"prepare": False}})
    pod = no_prepare.workload("decode")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["initContainers"]] == ["enroll", "lora-adapters"]
    for doc in manifests.docs + no_prepare.docs:
        checks.kubernetes_validate.validate(doc, checks.KUBE_VERSION, strict=True)


def test_modules_without_lora_on_are_refused(chart):
    with pytest.raises(checks.helm.HelmValuesError):
        chart.validate_schema({"lora": {"enabled": False, "source": "pvc", "pvc": {"claimName": "a"},
                                        "modules": MODULES}})

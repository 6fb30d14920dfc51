"""The chart's engine.attentionWindow reaches both worker roles' command lines, parsed by the
real CLI into the engine's cache config; power_of_two is a routing choice of the chart. The
rendering and parsing helpers are test_helm_chart's own."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

from pdserve.worker.settings import WorkerSettings

_spec = importlib.util.spec_from_file_location("helm_chart_checks", Path(__file__).with_name("test_helm_chart.py"))
checks = sys.modules.setdefault("helm_chart_checks", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(checks)


@pytest.fixture(scope="module")
def chart():
    with checks.helm.Chart.load(checks.CHART_DIR) as loaded:
        yield loaded


def _rendered(chart, values) -> list[dict]:
    out = checks.render_raw(chart, values, ())
    return [d for path, text in sorted(out.items()) if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def _settings(docs: list[dict], role: str, root=None) -> dict:
    """The role's settings; with `root`, its Secret files laid out there (`with_secret_files`)."""
    (workload,) = [d for d in docs if d.get("kind") in ("Deployment", "StatefulSet")
                   and d["metadata"]["name"].endswith(f"-{role}")]
    settings = checks.cli_settings(checks.main_container(workload))[1]
    return settings if root is None else checks.with_secret_files(docs, workload, settings, root)


@pytest.mark.parametrize("role", checks.WORKERS)
def test_attention_window_reaches_each_worker_and_its_engine(chart, role, tmp_path):
    values = {"engine": {"attentionWindow": 512}, "router": {"decodePolicy": "power_of_two"}}
    chart.validate_schema(values)
    docs = _rendered(chart, values)
    settings = _settings(docs, role, tmp_path)
    assert WorkerSettings.from_settings(role, settings).engine_config().cache.attention_window == 512
    assert _settings(docs, "router")["decode_policy"] == "power_of_two"
    assert "attention_window" not in _settings(_rendered(chart, {}), role)

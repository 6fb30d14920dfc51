"""The disk budget, the fallback chain and the backend names are declared once, in
`kvtransfer.config`: the worker's flags and their help, the transfer config, the disk store,
the benchmarks and the Helm chart's values agree with that declaration. Stores open by name
through the module their `StoreSpec` registers."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdserve.deploy.cli import build_parser
from pdserve.kvtransfer import backend_loader
from pdserve.kvtransfer.backends.disk import DiskStore
from pdserve.kvtransfer.config import (BACKENDS, DEFAULT_CHAIN, DISK_STORE_MAX_GB, STORE_SPECS, STORES,
                                       TRANSPORTS, KVTransferConfig)
from pdserve.kvtransfer.verdict import RECOMPUTE
from pdserve.worker.settings import SettingsError, WorkerSettings

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "pdserve"
WORKERS = ("prefill", "decode")
GIB = 2**30


def help_default(role: str, dest: str) -> str:
    """The default `pdserve <role> --help` quotes for `dest`."""
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    (action,) = [a for a in sub.choices[role]._actions if a.dest == dest]
    return re.search(r"\(default ([^)]*)\)$", action.help).group(1)


def chart_values(profile: str | None = None) -> dict:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    if profile is not None:
        overrides = yaml.safe_load((CHART / "ci" / f"{profile}.yaml").read_text()) or {}
        values["kvTransfer"]["diskStore"].update(overrides.get("kvTransfer", {}).get("diskStore", {}))
    return values


def quantity_bytes(text: str) -> int:
    number, unit = re.fullmatch(r"([0-9.]+)(Mi|Gi|Ti)", text).groups()
    return int(float(number) * {"Mi": 2**20, "Gi": GIB, "Ti": 2**40}[unit])


def test_the_disk_budget_is_the_declared_one_in_flags_help_config_store_and_chart(tmp_path):
    for role in WORKERS:
        settings = WorkerSettings.from_settings(role, {"disk_store": str(tmp_path)})
        assert settings.disk_store_max_gb == DISK_STORE_MAX_GB
        assert settings.transfer_config().disk_store_max_gb == DISK_STORE_MAX_GB
        assert help_default(role, "disk_store_max_gb") == str(DISK_STORE_MAX_GB)
    assert KVTransferConfig().disk_store_max_gb == DISK_STORE_MAX_GB
    assert DiskStore(tmp_path / "bare").max_bytes == int(DISK_STORE_MAX_GB * GIB)
    store = backend_loader.open_store("disk", KVTransferConfig(disk_store=str(tmp_path / "opened")))
    try:
        assert store.max_bytes == int(DISK_STORE_MAX_GB * GIB)
    finally:
        store.close()
    assert chart_values()["kvTransfer"]["diskStore"]["maxGB"] == DISK_STORE_MAX_GB


@pytest.mark.parametrize("profile", [None, "cpu-small", "gpu-2p4d", "kind", "external-redis"])
def test_each_chart_profile_budgets_its_disk_store_below_its_volume(profile):
    store = chart_values(profile)["kvTransfer"]["diskStore"]
    assert store["maxGB"] * GIB < quantity_bytes(store["size"]), store


def test_the_fallback_chain_is_the_declared_one_in_flags_help_and_config():
    assert KVTransferConfig().backends == DEFAULT_CHAIN and DEFAULT_CHAIN[-1] == RECOMPUTE
    assert set(DEFAULT_CHAIN) == set(BACKENDS) | {RECOMPUTE}
    for role in WORKERS:
        settings = WorkerSettings.from_settings(role, {})
        assert settings.transfer_config().backends == DEFAULT_CHAIN
        assert help_default(role, "kv_backends") == settings.kv_backends == ",".join(DEFAULT_CHAIN[:-1])


def test_the_backend_names_are_the_declared_ones_in_benchmarks_and_settings():
    from pdserve.bench import transfer

    assert BACKENDS == TRANSPORTS + STORES and not set(TRANSPORTS) & set(STORES)
    assert transfer.build_parser().get_default("backends") == ",".join(BACKENDS)
    (prefix_store,) = [f for f in dataclasses.fields(WorkerSettings) if f.name == "prefix_store"]
    assert prefix_store.metadata["choices"] == ("none", *STORES)


def test_the_chart_defaults_are_the_declared_chain_names_and_budget():
    values = chart_values()
    kv = values["kvTransfer"]
    # how the chart configures each store by default; a new store says so here
    configured = {"redis": values["redis"]["mode"] != "none", "disk": kv["diskStore"]["enabled"]}
    assert set(configured) == set(STORES)
    assert kv["backends"] == [b for b in DEFAULT_CHAIN if b in TRANSPORTS or configured.get(b)]
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["kvTransfer"]["properties"]
    assert schema["backends"]["items"]["enum"] == list(BACKENDS)
    assert set(schema["prefixStore"]["enum"]) == {"none", *STORES}


@pytest.mark.parametrize("name", STORES)
def test_a_store_opens_by_name_through_its_registered_module(name, tmp_path):
    spec = STORE_SPECS[name]
    assert spec.location in {f.name for f in dataclasses.fields(KVTransferConfig)}
    assert spec.location in {f.name for f in dataclasses.fields(WorkerSettings)}  # its worker flag
    assert callable(importlib.import_module(f"pdserve.kvtransfer.backends.{name}").create_store)
    with pytest.raises(backend_loader.NotConfigured, match=spec.flag):
        backend_loader.open_store(name, KVTransferConfig())
    assert not KVTransferConfig().store_configured(name) and KVTransferConfig().store_endpoint(name) == ""
    with pytest.raises(SettingsError, match=f"needs {spec.flag}"):
        WorkerSettings.from_settings("prefill", {"prefix_store": name})


def test_a_store_module_imports_its_dependency_only_when_the_store_is_created():
    code = ("import sys; import pdserve.kvtransfer.backends.redis as m; "
            "assert 'redis' not in sys.modules, 'imported at module load'; print(m.create_store.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "create_store", out.stderr

"""The security wing stands alone: every `pdserve.security` module imports without torch and
without grpc (so the router, the CLI and any adapter can ask it), and depends only on
`pdserve.common` among pdserve's components."""
import json
import pkgutil
import subprocess
import sys

import pdserve.security

PROBE = """
import importlib, json, pkgutil, sys
import pdserve.security as wing
names = sorted(m.name for m in pkgutil.iter_modules(wing.__path__))
for name in names:
    importlib.import_module("pdserve.security." + name)
loaded = sorted({m.split(".")[1] for m in sys.modules if m.startswith("pdserve.") and m.count(".") >= 1})
print(json.dumps({"modules": names, "torch": "torch" in sys.modules, "grpc": "grpc" in sys.modules,
                  "components": loaded}))
"""


def _probe() -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_security_module_loads_neither_torch_nor_grpc():
    found = _probe()
    expected = sorted(m.name for m in pkgutil.iter_modules(pdserve.security.__path__))
    assert found["modules"] == expected and len(expected) >= 5
    assert not found["torch"], "a pdserve.security module imports torch"
    assert not found["grpc"], "a pdserve.security module imports grpc"
    assert set(found["components"]) <= {"security", "common"}, found["components"]


def test_every_security_module_opens_with_its_threat_and_rule():
    import importlib

    for info in pkgutil.iter_modules(pdserve.security.__path__):
        doc = importlib.import_module(f"pdserve.security.{info.name}").__doc__ or ""
        assert "Threat:" in doc and "Rule:" in doc, f"pdserve.security.{info.name} does not name its threat and rule"

"""Two processes that need the native CPU kernel at once (a prefill and a decode starting
together) compile it once: the second waits on the first's lock, says so, and loads its build."""
from __future__ import annotations

import subprocess
import sys
import time

PROCESS = """
import logging, sys, time
from pathlib import Path
from pdserve.kernels.cpu_native import _build_once

logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
who, root = sys.argv[1], Path(sys.argv[2])
build_dir = root / "pdserve_cpu_attention_test"
build_dir.mkdir(parents=True, exist_ok=True)

def load():
    built = build_dir / "pdserve_cpu_attention_test.so"
    if not built.exists():
        print(f"{who} COMPILES", flush=True)
        (root / f"{who}-compiling").touch()
        deadline = time.monotonic() + 60
        while not (root / "b-waiting").exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # the "compile" lasts until the other process waits on it
        built.write_text("binary")
    return built.read_text()

class Waiting(logging.Handler):  # b says it waits on a's lock: a's "compile" may end
    def emit(self, record):
        if "waiting for another process" in record.getMessage():
            (root / "b-waiting").touch()

logging.getLogger().addHandler(Waiting())
print(who, "loaded", _build_once("pdserve_cpu_attention_test", build_dir, load), flush=True)
"""


def _wait_for(path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def test_two_processes_compile_the_kernel_once(tmp_path):
    a = subprocess.Popen([sys.executable, "-c", PROCESS, "a", str(tmp_path)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    _wait_for(tmp_path / "a-compiling")  # a holds the lock and compiles
    b = subprocess.Popen([sys.executable, "-c", PROCESS, "b", str(tmp_path)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    out_a, _ = a.communicate(timeout=120)
    out_b, _ = b.communicate(timeout=120)
    both = out_a + out_b
    assert a.returncode == 0 and b.returncode == 0, both
    assert both.count("COMPILES") == 1, both
    assert "a loaded binary" in out_a and "b loaded binary" in out_b
    assert "waiting for another process compiling native CPU attention" in out_b, out_b
    assert "built by another process" in out_b
    assert out_a.count("compiling native CPU attention") >= 1 and "compiling native CPU attention" not in \
        out_b.replace("waiting for another process compiling native CPU attention", "")


def test_a_worker_loads_the_kernel_prepared_in_a_read_only_seed(tmp_path, monkeypatch):
    """What the chart's serving pods do: the kernel `pdserve prepare` built sits in a cache
    mounted read-only (PDSERVE_CACHE_SEED); it is imported from there, nothing is written."""
    import os
    import stat

    import pytest

    from pdserve.kernels import cpu_native

    built = cpu_native._load()
    if isinstance(built, Exception):
        pytest.skip(f"no native kernel here: {built}")
    name, path = built.__name__, os.path.realpath(built.__file__)
    seed = tmp_path / "seed"
    (seed / "torch_extensions" / name).mkdir(parents=True)
    copy = seed / "torch_extensions" / name / f"{name}.so"
    copy.write_bytes(open(path, "rb").read())
    for folder in (copy, copy.parent, copy.parent.parent, seed):
        folder.chmod(stat.S_IMODE(folder.stat().st_mode) & ~0o222)  # read-only, as mounted
    monkeypatch.setenv("PDSERVE_CACHE_SEED", str(seed))
    assert cpu_native._prepared(name) == copy
    module = cpu_native._import_built(name, copy)
    assert all(hasattr(module, fn) for fn in cpu_native._FUNCTIONS)
    monkeypatch.setenv("PDSERVE_CACHE_SEED", str(tmp_path / "empty"))
    assert cpu_native._prepared(name) is None

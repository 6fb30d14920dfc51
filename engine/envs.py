"""The one place pdserve reads environment variables.

Everything else receives values explicitly (typed configs). Each entry: name, default, meaning.
"""
from __future__ import annotations

import os
from pathlib import Path

ENV_PREFIX = "PDSERVE_"

# name -> (default, help). `pdserve` CLI flags map onto PDSERVE_<FLAG_NAME> as well.
KNOWN = {
    "PDSERVE_CACHE_ROOT": ("~/.cache/pdserve", "root of the build cache (converted models)"),
    "PDSERVE_CACHE_ENABLED": ("1", "0 turns the build cache off (convert on every start)"),
    "PDSERVE_CACHE_MAX_RECORDS": ("8", "build cache: most records kept"),
    "PDSERVE_CACHE_MAX_STORAGE_GB": ("20", "build cache: most gigabytes kept"),
    "PDSERVE_USE_TRITON": ("auto", "auto: Triton kernels on CUDA, torch references on CPU; "
                                   "1: Triton everywhere (CPU needs TRITON_INTERPRET=1); 0: never"),
    "PDSERVE_LOG_LEVEL": ("INFO", "log level of every process"),
    "TRITON_INTERPRET": ("0", "read by Triton itself when it compiles a kernel; pdserve reads it only "
                              "to refuse PDSERVE_USE_TRITON=1 on CPU without the interpreter"),
}


def get(name: str) -> str:
    default, _ = KNOWN[name]
    return os.environ.get(name, default)


def get_bool(name: str) -> bool:
    return get(name).strip().lower() not in ("0", "false", "no", "off", "")


def cache_root() -> Path:
    return Path(get("PDSERVE_CACHE_ROOT")).expanduser()


def prefixed(environ: dict[str, str] | None = None) -> dict[str, str]:
    """All PDSERVE_* variables, for the CLI to overlay on flags (lower-cased, prefix cut)."""
    environ = os.environ if environ is None else environ
    return {k[len(ENV_PREFIX):].lower(): v for k, v in environ.items() if k.startswith(ENV_PREFIX)}

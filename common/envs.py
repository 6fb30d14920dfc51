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
    "PDSERVE_CACHE_SEED": ("", "a read-only build cache consulted before building, e.g. the models "
                               "an image prepared at build time (`pdserve prepare`)"),
    "PDSERVE_CACHE_ENABLED": ("1", "0 turns the build cache off (convert on every start)"),
    "PDSERVE_CACHE_MAX_RECORDS": ("8", "build cache: most records kept"),
    "PDSERVE_CACHE_MAX_STORAGE_GB": ("20", "build cache: most gigabytes kept"),
    "PDSERVE_USE_TRITON": ("auto", "auto: Triton kernels on CUDA, torch references on CPU; "
                                   "1: Triton everywhere (CPU needs TRITON_INTERPRET=1); 0: never"),
    "PDSERVE_CPU_ATTENTION": ("auto", "CPU decode attention: auto (native C++ kernel, built on first use, "
                                      "else the torch path with a warning), native (must build), torch"),
    "PDSERVE_CPU_ISA": ("native", "instruction set of the native CPU kernels: native (this CPU's best, "
                                  "chosen at start and logged), avx512vnni, avxvnni, avx2 (AVX-512 off in "
                                  "the float kernels too) or scalar (integer-dot kernels in plain C): to "
                                  "run a lower path on a machine that has a higher one"),
    "PDSERVE_CPU_PREPACK": ("1", "1: fp32 CPU linears use weights prepacked once at load for oneDNN "
                                 "(faster small-batch decode); 0: plain F.linear on MKL (A/B switch)"),
    "PDSERVE_LOG_LEVEL": ("INFO", "log level of every process"),
    "TRITON_INTERPRET": ("0", "read by Triton itself when it compiles a kernel; pdserve reads it only "
                              "to refuse PDSERVE_USE_TRITON=1 on CPU without the interpreter"),
    # kv transfer, ucx backend: read once, when the process's UCX context starts
    "PDSERVE_UCX_TLS": ("auto", "UCX transports for KV transfer; auto: tcp,posix,sysv,self (no cma: a "
                                "sender dying mid-read aborts the receiver) "
                                "(+cuda_copy,cuda_ipc where CUDA is available); with host "
                                "transports only, UCX's memory hooks stay off (UCX_MEM_EVENTS=no "
                                "unless the environment sets it)"),
    "PDSERVE_UCX_NET_DEVICES": ("auto", "network devices UCX may use; auto: lo when the transfer "
                                        "host is a loopback address, else all"),
    "PDSERVE_UCX_RNDV_THRESH": ("8192", "UCX rendezvous threshold (bytes, or auto)"),
    "PDSERVE_UCX_TCP_TX_SEG_SIZE": ("256k", "UCX TCP send segment size (UCX's own default: 8k)"),
    "PDSERVE_UCX_TCP_RX_SEG_SIZE": ("1m", "UCX TCP receive segment size (UCX's own default: 64k)"),
    "PDSERVE_UCX_ERROR_HANDLING": ("0", "1: UCX peer-failure detection on endpoints (excludes the "
                                        "shared-memory zero-copy path; deadlines catch dead peers)"),
    "PDSERVE_UCX_OPTIONS": ("", "extra UCX options for tuning, 'KEY=VALUE ...' (UCX_ prefix optional)"),
    # kv transfer
    "PDSERVE_KV_LAYERWISE": ("1", "1: a prefill streams each layer's KV of each prompt chunk as it is "
                                  "computed (ucx/nccl); 0: the whole prompt is sent after its forward (A/B switch)"),
    # kv transfer, nccl backend
    "PDSERVE_NCCL_BACKEND": ("auto", "process groups of the nccl transport: gloo, nccl, or auto "
                                     "(nccl where CUDA is available, else gloo)"),
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

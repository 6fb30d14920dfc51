"""Which implementation a wrapper runs: the Triton kernel or the torch path.

`PDSERVE_USE_TRITON` (read through `pdserve.common.envs`, per call so tests may change it):

* ``auto``: Triton for CUDA tensors, torch otherwise. A CUDA machine without triton falls
  back to torch and logs a warning once (never silently).
* ``1``: Triton always. On CPU that needs Triton's interpreter, i.e. ``TRITON_INTERPRET=1``
  set before the kernel modules are first imported (Triton decides at decoration time).
* ``0``: torch always.

triton itself is imported only inside the Triton path (the `triton_*` modules), so a
process that never takes it never pays for the import, and a machine without triton works.
"""
from __future__ import annotations

import functools
import importlib.util
import logging

import torch

from pdserve.common import envs

log = logging.getLogger(__name__)

_MODES = {"auto": "auto", "1": "triton", "true": "triton", "yes": "triton", "on": "triton",
          "0": "torch", "false": "torch", "no": "torch", "off": "torch"}


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run under the CPU interpreter."""
    return envs.get_bool("TRITON_INTERPRET")


def use_triton(device: torch.device) -> bool:
    """True when the wrapper for tensors on `device` must launch its Triton kernel."""
    raw = envs.get("PDSERVE_USE_TRITON").strip().lower()
    mode = _MODES.get(raw)
    if mode is None:
        raise ValueError(f"PDSERVE_USE_TRITON={raw!r}: expected auto, 1 or 0")
    if mode == "torch":
        return False
    if mode == "auto":
        if device.type != "cuda":
            return False
        if not triton_installed():
            _warn_no_triton_once()
            return False
        return True
    if not triton_installed():
        raise RuntimeError("PDSERVE_USE_TRITON=1 but triton is not installed (pip install 'pdserve[triton]')")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"PDSERVE_USE_TRITON=1 on {device.type} tensors needs TRITON_INTERPRET=1, "
            "set before triton is imported")
    return True


@functools.cache
def _warn_no_triton_once() -> None:
    log.warning("CUDA tensors but triton is not installed: kernels run their torch paths (slow)")

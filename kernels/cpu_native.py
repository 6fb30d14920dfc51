"""Native (C++) CPU kernels, compiled on first use and cached: decode attention, the
fused small steps of a decoder layer (`csrc/cpu_fused_layer.cpp`, see `kernels.fused`), batched
LoRA updates (`csrc/cpu_lora.cpp`, see `kernels.lora`), and
linears over a GGUF file's quantized blocks (`csrc/cpu_quant_gemm.cpp`, see `kernels.quant`).

`csrc/cpu_decode_attention.cpp` reads K/V in place through the block table; the torch path
(`torch_paths.paged_decode_attention`) must first gather them into a padded batch, which at
SmolLM2's shape and batch 32 costs most of its time. The extension is built by torch's JIT
builder (needs a C++ compiler and ninja) into `<PDSERVE_CACHE_ROOT>/torch_extensions/<name>`,
where the name hashes the source, the torch version and this CPU's instruction-set flags,
so a cache directory shared between machines never hands one a binary built for another.
Several processes starting at once build it once: the first takes `<build dir>.lock` and
compiles, the others wait on it (saying so) and load what it built.

`PDSERVE_CPU_ATTENTION` picks the path: ``auto`` (native when it builds, else the torch
path with one warning naming the reason), ``native`` (a failed build is an error), or
``torch``.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path
from typing import Callable

import torch

from pdserve.common import envs, progress

log = logging.getLogger(__name__)

_SOURCES = tuple(Path(__file__).with_name("csrc") / name
                 for name in ("cpu_vectors.cpp", "cpu_decode_attention.cpp", "cpu_fused_layer.cpp",
                              "cpu_quant_gemm.cpp", "cpu_lora.cpp"))
_FUNCTIONS = ["paged_decode_attention", "add_rms_norm", "rope_store_kv", "quant_linear", "dequantize_rows",
              "dequantize_rows_into", "has_bf16_gemm", "quant_linear_bf16", "lora_add"]
# PDSERVE_CPU_ISA -> flags after -march=native for the float kernels; the integer-dot build
# holds every path and takes the name itself (`kernels.int8_dot`)
_ISAS = {"native": [], "avx512vnni": [], "avxvnni": ["-mno-avx512f"], "avx2": ["-mno-avx512f"],
         "scalar": ["-mno-avx512f"]}
_INT8_DOT = (Path(__file__).with_name("csrc") / "cpu_int8_dot.cpp", Path(__file__).with_name("csrc") / "int8_dot_tiles.h")
_INT8_DOT_FLAGS = ["-O3", "-fopenmp"]  # the baseline x86-64: each vector path names its own target
_MODES = ("auto", "native", "torch")
BUILD_LOCK_TIMEOUT_S = 900.0  # the longest wait on another process's compile


class NativeBuildError(RuntimeError):
    """The native CPU kernels could not be built or loaded (and PDSERVE_CPU_ATTENTION=native)."""


def mode() -> str:
    raw = envs.get("PDSERVE_CPU_ATTENTION").strip().lower()
    if raw not in _MODES:
        raise ValueError(f"PDSERVE_CPU_ATTENTION={raw!r}: expected one of {', '.join(_MODES)}")
    return raw


def decode_attention_op() -> Callable[..., torch.Tensor] | None:
    """The native op `(query_f32_scaled, kv_cache, block_tables, context_lens, window) -> out_f32`,
    or None where the torch path must run (mode ``torch``, or ``auto`` and the build failed)."""
    chosen = mode()
    if chosen == "torch":
        return None
    module = _load()
    if isinstance(module, Exception):
        if chosen == "native":
            raise NativeBuildError(f"native CPU attention did not build: {module}") from module
        _warn_once(str(module))
        return None
    return module.paged_decode_attention


def fused_layer_module() -> object | None:
    """The extension's fused layer ops (`add_rms_norm`, `rope_store_kv`), or None where the
    torch path must run (same rules as `decode_attention_op`)."""
    return None if decode_attention_op() is None else _load()


def lora_op() -> Callable[..., torch.Tensor] | None:
    """The batched LoRA update `lora_add` (`csrc/cpu_lora.cpp`, see `kernels.lora`), or None
    where the torch path must run (same rules as `decode_attention_op`)."""
    return None if decode_attention_op() is None else _load().lora_add


def quant_module() -> object:
    """The extension's GGUF block GEMM (`quant_linear`, `dequantize_rows`), whatever
    PDSERVE_CPU_ATTENTION says: there is no torch path to fall back to. Raises
    NativeBuildError when the extension does not build."""
    module = _load()
    if isinstance(module, Exception):
        raise NativeBuildError(f"native CPU kernels did not build: {module}") from module
    return module


def int8_dot_module() -> object:
    """The integer-dot GGUF extension (`csrc/cpu_int8_dot.cpp`: `quantize_activations`,
    `int8dot_linear`, `supported_isas`), one build with every instruction-set path in it.
    Raises NativeBuildError when it does not build."""
    module = _load_int8_dot()
    if isinstance(module, Exception):
        raise NativeBuildError(f"integer-dot CPU kernels did not build: {module}") from module
    return module


def backend_name() -> str:
    """What CPU decode attention runs in this process, 'native' or 'torch'. Builds the
    extension if needed, so a service calls it at start, not on its first request."""
    return "native" if decode_attention_op() is not None else "torch"


@functools.cache
def _load() -> object:
    """The loaded extension module, or the exception that stopped the build (kept, so a
    failing build is tried once per process, not once per layer)."""
    try:
        source = source_text()
        flags = _flags()
        name = "pdserve_cpu_attention_" + _fingerprint(source, flags)
        prepared = _prepared(name)
        if prepared is not None:
            log.info("loading native CPU attention %s (prepared in %s)", name, prepared.parent)
            return _import_built(name, prepared)
        build_dir = envs.cache_root() / "torch_extensions" / name
        build_dir.mkdir(parents=True, exist_ok=True)
        return _build_once(name, build_dir, lambda: _compile(name, build_dir, source, flags))
    except Exception as e:  # compiler missing, ninja missing, read-only cache root, ...
        return e


@functools.cache
def _load_int8_dot() -> object:
    """As `_load`, for the integer-dot extension, built from files (its tiles are included
    once per instruction set) for the baseline x86-64."""
    try:
        source = "\n".join(path.read_text() for path in _INT8_DOT)
        name = "pdserve_cpu_int8_dot_" + _fingerprint(source, _INT8_DOT_FLAGS)
        prepared = _prepared(name)
        if prepared is not None:
            return _import_built(name, prepared)
        build_dir = envs.cache_root() / "torch_extensions" / name
        build_dir.mkdir(parents=True, exist_ok=True)
        return _build_once(name, build_dir, lambda: _compile_files(name, build_dir))
    except Exception as e:  # compiler missing, ninja missing, read-only cache root, ...
        return e


def _compile_files(name: str, build_dir: Path) -> object:
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name=name, sources=[str(_INT8_DOT[0])], extra_include_paths=[str(_INT8_DOT[0].parent)],
        extra_cflags=_INT8_DOT_FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)


def _prepared(name: str) -> Path | None:
    """The extension as a read-only seed cache (PDSERVE_CACHE_SEED, what `pdserve prepare`
    filled) holds it, or None: loaded in place, never written."""
    seed = envs.get("PDSERVE_CACHE_SEED")
    if not seed:
        return None
    built = Path(seed).expanduser() / "torch_extensions" / name / f"{name}.so"
    return built if built.is_file() else None


def _import_built(name: str, path: Path) -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(name: str, build_dir: Path, source: str, flags: list[str]) -> object:
    from torch.utils import cpp_extension

    return cpp_extension.load_inline(
        name=name, cpp_sources=[source], functions=_FUNCTIONS,
        extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)


def _build_once(name: str, build_dir: Path, load: Callable[[], object]) -> object:
    """`load()` the extension, compiling it first if no process has: the first process to take
    `<build_dir>.lock` compiles, the others say they wait and then load what it built (as the
    build cache does for a model), so a machine compiles each kernel build once."""
    from filelock import FileLock, Timeout

    built = build_dir / f"{name}.so"
    if built.exists():
        log.info("loading native CPU attention %s (built before)", name)
        return load()
    lock = FileLock(f"{build_dir}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        with progress.step(f"waiting for another process compiling native CPU attention {name}"):
            lock.acquire(timeout=BUILD_LOCK_TIMEOUT_S)
    try:
        if built.exists():
            log.info("loading native CPU attention %s (built by another process)", name)
            return load()
        with progress.step(f"compiling native CPU attention {name} for this CPU, once (about a minute)"):
            return load()
    finally:
        lock.release()


def source_text() -> str:
    """The C++ the extension is built from (its files, joined)."""
    return "\n".join(path.read_text() for path in _SOURCES)


def isa_setting() -> str:
    """PDSERVE_CPU_ISA, checked: native (this CPU's best), avx512vnni, avxvnni, avx2 or scalar."""
    isa = envs.get("PDSERVE_CPU_ISA").strip().lower()
    if isa not in _ISAS:
        raise ValueError(f"PDSERVE_CPU_ISA={isa!r}: expected one of {', '.join(_ISAS)}")
    return isa


def _flags() -> list[str]:
    native = "-march=native" if platform.machine() in ("x86_64", "AMD64") else "-mcpu=native"
    isa = isa_setting()
    # -fopenmp: ATen's parallel_for is an inline OpenMP region, serial without it. The
    # libgomp.so.1 it needs is the one torch has already loaded (same soname).
    return ["-O3", "-fopenmp", native, *_ISAS[isa]]


def _fingerprint(source: str, flags: list[str]) -> str:
    digest = hashlib.sha256()
    for part in (source, " ".join(flags), torch.__version__, platform.machine(), _cpu_flags()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    """The instruction-set flags of this CPU (Linux), so -march=native builds never travel."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("native CPU attention unavailable, decode attention runs the slower torch path: %s", reason)

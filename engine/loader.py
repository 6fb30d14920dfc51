"""Model loading: a spec ("default", a transformers directory, a .gguf file) -> LoadedModel.

Every spec ends as a transformers-format directory (config.json, *.safetensors, tokenizer
files). A GGUF file is converted once through transformers (dequantised to float32) and the
result kept in the build cache, so later starts read safetensors and never touch the GGUF
path again. Weights are only ever read from safetensors (no pickles).

Heavy imports (torch, transformers, safetensors) happen inside the functions that need them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import mmap
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.engine import default_model
from pdserve.common import progress
from pdserve.engine.build_cache import BuildCache, BuildInputs
from pdserve.engine.config import ModelConfig
from pdserve.common.errors import InvalidRequestError, ModelLoadError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
GGUF_CONVERT_KIND = "gguf-convert"
GGUF_CONVERTER_VERSION = "1"  # bump when the conversion writes something different
SUPPORTED_GGUF_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
_GGUF_SHAPE_KEYS = ("block_count", "embedding_length", "feed_forward_length",
                    "attention.head_count")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|BF16|F16|F32)$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready to build an engine from. `model_dir` is a transformers-format directory."""

    name: str  # the served model name
    model_dir: Path
    hf_config: Any  # transformers PretrainedConfig
    model_config: ModelConfig
    tokenizer: Any | None  # transformers PreTrainedTokenizerFast; None when the dir has none
    dtype: str = "float32"
    converted: bool = False  # True when this load ran the GGUF conversion (build cache miss)
    gguf_path: Path | None = None  # the GGUF file the directory was converted from, if any

    def load_state_dict(self, device: str = "cpu",
                        dtype: str | None = None) -> dict[str, torch.Tensor]:
        """The weights under transformers' names (`model.layers.0.self_attn.q_proj.weight`...).

        Floating tensors are cast to `dtype` (default: the model's). `lm_head.weight` is
        absent when the checkpoint ties it to `model.embed_tokens.weight`.
        """
        import torch
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        target = getattr(torch, _check_dtype(dtype or self.dtype))
        weights: dict[str, torch.Tensor] = {}
        for file in weight_files(self.model_dir):
            try:
                tensors = load_file(file, device=str(device))
            except (SafetensorError, OSError) as e:
                raise ModelLoadError(f"cannot read weights {file}: {e}") from e
            for name, tensor in tensors.items():
                weights[name] = tensor.to(target) if tensor.is_floating_point() else tensor
        return weights


def load_model(spec: str = "default", *, dtype: str = "float32",
               build_cache: BuildCache | None = None) -> LoadedModel:
    """Resolves `spec` and loads config and tokenizer (weights load lazily, by
    `LoadedModel.load_state_dict`). Raises ModelLoadError with the reason on any failure."""
    _check_dtype(dtype)
    if spec == "default":
        gguf_path, name = default_model.locate(), default_model.DEFAULT_MODEL.name
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise ModelLoadError(
                f"model {spec!r} not found: expected 'default', a transformers model directory "
                f"or a .gguf file on this machine (pdserve never downloads from a model hub)")
        if path.is_dir():
            return _load_dir(path, path.name, dtype)
        gguf_path, name = path, _QUANT_SUFFIX.sub("", path.stem)
    model_dir, converted = convert_gguf(gguf_path, build_cache or BuildCache.from_env())
    return dataclasses.replace(_load_dir(model_dir, name, dtype, converted=converted), gguf_path=gguf_path)


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a transformers checkpoint (sharded or not)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ModelLoadError(f"unreadable {index}: {e}") from e
        return [model_dir / shard for shard in shards]
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    # "consolidated*.safetensors" are the original (non-transformers) layout some repos add.
    return sorted(p for p in model_dir.glob("*.safetensors")
                  if not p.name.startswith("consolidated"))


# ---- transformers directories -----------------------------------------------------------

def _load_dir(model_dir: Path, name: str, dtype: str, converted: bool = False) -> LoadedModel:
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir} has no config.json: not a transformers model directory")
    files = weight_files(model_dir)
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise ModelLoadError(f"{model_dir} has no usable *.safetensors weights"
                             + (f" (missing {', '.join(missing)})" if missing else "")
                             + "; pdserve does not read pickled (.bin/.pt) checkpoints")
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {e}") from e
    _check_supported(hf_config, model_dir)
    try:
        model_config = ModelConfig.from_hf(hf_config, name=name)
    except (InvalidRequestError, AttributeError, TypeError) as e:
        raise ModelLoadError(f"unusable model config in {model_dir}: {e}") from e
    eos_ids = _merge_ids(model_config.eos_token_ids, _generation_eos_ids(model_dir))
    model_config = dataclasses.replace(model_config, eos_token_ids=eos_ids)
    return LoadedModel(name=name, model_dir=model_dir, hf_config=hf_config,
                       model_config=model_config, tokenizer=_load_tokenizer(model_dir),
                       dtype=dtype, converted=converted)


def _check_supported(hf_config: Any, model_dir: Path) -> None:
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{model_dir}: unsupported activation {act!r} (only silu)")
    if getattr(hf_config, "mlp_bias", False):
        raise ModelLoadError(f"{model_dir}: MLP biases are not supported")


def _load_tokenizer(model_dir: Path) -> Any | None:
    if not any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {e}") from e


def _generation_eos_ids(model_dir: Path) -> tuple[int, ...]:
    """generation_config.json often names more end tokens than config.json (chat models)."""
    try:
        eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()
    eos = eos if isinstance(eos, list) else [eos]
    return tuple(e for e in eos if isinstance(e, int))


def _merge_ids(first: tuple[int, ...], second: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(first + second))


def _check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise InvalidRequestError(f"unsupported dtype {dtype!r} (one of {', '.join(DTYPES)})")
    return dtype


# ---- GGUF -------------------------------------------------------------------------------

def convert_gguf(gguf_path: Path, cache: BuildCache) -> tuple[Path, bool]:
    """The transformers directory converted from `gguf_path`, from the build cache when it
    holds one. Returns (directory, whether this call converted)."""
    summary = read_gguf_summary(gguf_path)
    arch = summary.architecture
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ModelLoadError(f"{gguf_path}: unsupported architecture {arch!r} "
                             f"(supported: {', '.join(SUPPORTED_GGUF_ARCHS)})")
    # transformers silently substitutes defaults for missing shape keys (a 7B-sized random
    # model for llama): insist on them up front.
    required = [f"{arch}.{k}" for k in _GGUF_SHAPE_KEYS] + ["tokenizer.ggml.tokens"]
    missing = [k for k in required if k not in summary.keys]
    if missing:
        raise ModelLoadError(f"{gguf_path} is incomplete: no {', '.join(missing)}")
    inputs = BuildInputs.of(
        values={"converter": GGUF_CONVERTER_VERSION, "dtype": "float32",
                "transformers": metadata.version("transformers"), "gguf": metadata.version("gguf")},
        files={"gguf": gguf_path})
    result = cache.get_or_build(GGUF_CONVERT_KIND, inputs, lambda out: _gguf_to_dir(gguf_path, out),
                                description=f"GGUF -> safetensors conversion of {gguf_path.name}")
    return result.path, result.built


def _gguf_to_dir(gguf_path: Path, out: Path) -> None:
    """Dequantises the GGUF through transformers and writes a transformers directory."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder, filename = str(gguf_path.parent), gguf_path.name
    part = ["reading and dequantising the GGUF (1 of 3)"]
    hf_logging.disable_progress_bar()  # our lines say it; transformers' bars arrive as dozens of lines
    try:
        with progress.step(f"converting {filename} to safetensors, once (about 30 s for the default "
                           "model on 2 cores)", doing=lambda: part[0]):
            with _unreadable_gguf(gguf_path):
                model, info = AutoModelForCausalLM.from_pretrained(
                    folder, gguf_file=filename, dtype=torch.float32, output_loading_info=True)
            _check_complete(model, info, gguf_path)
            part[0] = "reading the tokenizer (2 of 3)"
            with _unreadable_gguf(gguf_path):
                tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
            part[0] = "writing safetensors (3 of 3)"
            save_file(_unshared_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
            config = model.config
            if hasattr(config, "quantization_config"):  # the weights we write are plain float32
                delattr(config, "quantization_config")
            config.save_pretrained(out)
            model.generation_config.save_pretrained(out)
            # save_jinja_files=False: the chat template goes into tokenizer_config.json.
            tokenizer.save_pretrained(out, save_jinja_files=False)
    finally:
        hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _unreadable_gguf(gguf_path: Path) -> Iterator[None]:
    try:
        yield
    except Exception as e:  # the GGUF reader fails in many ways; all mean "unreadable"
        raise ModelLoadError(f"transformers could not read GGUF file {gguf_path} "
                             f"(corrupt or unsupported?): {type(e).__name__}: {e}") from e


def _check_complete(model: Any, info: dict, gguf_path: Path) -> None:
    """transformers fills weights the GGUF lacks with random values; refuse that."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = sorted(k for k in info.get("missing_keys", ())
                     if not (tied and k == "lm_head.weight"))
    if missing:
        raise ModelLoadError(f"{gguf_path} lacks {len(missing)} weights the model needs "
                             f"(e.g. {', '.join(missing[:3])}); refusing to fill them randomly")


def _unshared_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The state dict as safetensors wants it: contiguous, no two tensors sharing memory.
    A tied lm_head is left out (transformers re-ties it on load)."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        tensor = tensor.detach().contiguous()
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        tensors[name] = tensor
    return tensors


@dataclass(frozen=True, slots=True)
class GGUFSummary:
    architecture: str  # general.architecture: "llama", "qwen2"...
    name: str  # general.name, "" when absent
    num_tensors: int
    data_bytes: int  # bytes from the start of the tensor data to the end of the last tensor
    keys: frozenset[str]  # every metadata key present


def read_gguf_summary(path: Path) -> GGUFSummary:
    """Walks a GGUF file's header and tensor table without reading tensor data, checking every
    length against the file size: a non-GGUF, corrupt or truncated file fails here, in well
    under a second, with a ModelLoadError."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < 24:
                raise ModelLoadError(f"{path} is not a GGUF file (only "
                                     f"{os.fstat(f.fileno()).st_size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _GGUFScanner(buf, path).scan()
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}  # GGUF value type -> struct format
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_KEYS = ("general.architecture", "general.name", "general.alignment")


class _GGUFScanner:
    """Little-endian GGUF v2/v3: magic, version u32, tensor count u64, kv count u64,
    kv pairs (string key, u32 type, value), tensor infos (string name, u32 n_dims,
    u64 dims[n_dims], u32 ggml type, u64 offset), padding to `general.alignment`, data."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos = buf, path, 0

    def scan(self) -> GGUFSummary:
        if self.buf[:4] != b"GGUF":
            raise ModelLoadError(f"{self.path} is not a GGUF file (magic {bytes(self.buf[:4])!r})")
        self.pos = 4
        version = self.take("<I")
        if version not in (2, 3):
            raise ModelLoadError(f"{self.path}: unsupported GGUF version {version} (need 2 or 3, "
                                 f"little-endian)")
        num_tensors, num_kv = self.take("<Q"), self.take("<Q")
        if num_tensors > 1 << 20 or num_kv > 1 << 20:
            raise self.corrupt(f"implausible counts ({num_tensors} tensors, {num_kv} keys)")
        found: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self.string().decode("utf-8", "replace")
            found[key] = self.value(self.take("<I"), keep=key in _GGUF_KEYS)
        data_bytes = 0
        for _ in range(num_tensors):
            data_bytes = max(data_bytes, self.tensor_end())
        alignment = found.get("general.alignment") or 32
        if not isinstance(alignment, int) or alignment <= 0:
            raise self.corrupt(f"bad general.alignment {alignment!r}")
        data_start = -(-self.pos // alignment) * alignment
        if data_start + data_bytes > len(self.buf):
            raise self.corrupt(f"truncated: tensor data ends at byte {data_start + data_bytes}, "
                               f"the file has {len(self.buf)}")
        arch = found.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise self.corrupt("no general.architecture key")
        return GGUFSummary(architecture=arch, name=str(found.get("general.name") or ""),
                           num_tensors=num_tensors, data_bytes=data_bytes,
                           keys=frozenset(found))

    def tensor_end(self) -> int:
        from gguf.constants import GGML_QUANT_SIZES

        name = self.string()
        num_dims = self.take("<I")
        if num_dims > 8:
            raise self.corrupt(f"tensor {name!r} has {num_dims} dims")
        dims = [self.take("<Q") for _ in range(num_dims)]
        ggml_type, offset = self.take("<I"), self.take("<Q")
        if ggml_type not in GGML_QUANT_SIZES:
            raise self.corrupt(f"tensor {name!r} has unknown ggml type {ggml_type}")
        block, type_bytes = GGML_QUANT_SIZES[ggml_type]
        return offset + math.prod(dims) // block * type_bytes

    def value(self, vtype: int, keep: bool) -> Any:
        if vtype in _GGUF_SCALARS:
            return self.take(_GGUF_SCALARS[vtype])
        if vtype == _GGUF_STRING:
            text = self.string()
            return text.decode("utf-8", "replace") if keep else None
        if vtype != _GGUF_ARRAY:
            raise self.corrupt(f"unknown GGUF value type {vtype} at byte {self.pos}")
        item_type, count = self.take("<I"), self.take("<Q")
        if item_type in _GGUF_SCALARS:
            self.skip(count * struct.calcsize(_GGUF_SCALARS[item_type]))
        elif count > len(self.buf) - self.pos:  # every item takes at least one byte
            raise self.corrupt(f"truncated: array of {count} items at byte {self.pos}")
        else:
            for _ in range(count):
                self.value(item_type, keep=False)
        return None

    def string(self) -> bytes:
        size = self.take("<Q")
        start = self.pos
        self.skip(size)
        return self.buf[start:self.pos]

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.skip(size)
        return struct.unpack_from(fmt, self.buf, self.pos - size)[0]

    def skip(self, size: int) -> None:
        if self.pos + size > len(self.buf):
            raise self.corrupt(f"truncated: needs byte {self.pos + size}, the file has "
                               f"{len(self.buf)}")
        self.pos += size

    def corrupt(self, why: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path} is not a valid GGUF file: {why}")

"""An engine's parts, built from its config in order: load the model, quantize its weights,
build the forward, size the KV cache, fingerprint the cache layout (the compatibility hash
peers check before they exchange KV), and hand the layout to the connector. `LLMEngine`
wires what `assemble` returns and does none of this itself.

Where a `--quantization` value gets its weights is `QUANTIZED_LINEARS`, one row per value.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.engine import gguf_weights
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, kv_weights
from pdserve.engine.connector import Connector, ConnectorFactory, KVCacheLayout
from pdserve.engine.fingerprint import weights_fingerprint
from pdserve.engine.kv_cache_manager import DTYPES, KVCacheManager
from pdserve.engine.models.llama import CausalLM
from pdserve.engine.speculation import NO_SPECULATION, NoSpeculation, Speculator

log = logging.getLogger("pdserve.engine")


def _no_linears(mode: str, loaded, state: dict[str, torch.Tensor]) -> dict:
    return {}  # the forward serves the float32 state, quantized by the mode's name (CausalLM)


# --quantization: each value the engine runs (config.QUANTIZATIONS, "auto" resolved first)
# and the pre-quantized linears its forward serves beside the float32 state dict. A new
# value is one row here.
QUANTIZED_LINEARS: dict[str, Callable[[str, object, dict[str, torch.Tensor]], dict]] = {
    "": _no_linears,
    "int8": _no_linears,
    "gguf": gguf_weights.gguf_blocks,
    "gguf-fast": gguf_weights.gguf_blocks,
    "gguf-int8dot": gguf_weights.gguf_blocks,
    "gguf-int16dot": gguf_weights.gguf_blocks,
}


def quantize(config: EngineConfig, loaded, state: dict[str, torch.Tensor]) -> tuple[str, dict]:
    """(the quantization the engine runs, the linears it serves quantized)."""
    mode = gguf_weights.resolve_auto(config, loaded) if config.quantization == "auto" else config.quantization
    return mode, QUANTIZED_LINEARS[mode](mode, loaded, state)


@dataclass(frozen=True, slots=True)
class EngineParts:
    """What an engine is made of. `config` has its quantization resolved; `kv` is sized;
    `connector` holds the cache tensors registered under `layout`."""

    config: EngineConfig
    loaded: object  # loader.LoadedModel
    model: CausalLM
    max_model_len: int
    kv: KVCacheManager
    layout: KVCacheLayout
    connector: Connector
    speculator: NoSpeculation  # a Speculator, or NO_SPECULATION


def assemble(config: EngineConfig, connector: Connector | ConnectorFactory | None = None,
             loaded=None) -> EngineParts:
    """Build the parts for `config`. `loaded`: a model loaded already (several engines of
    one model); `connector`: a ready pair, or a factory called with the cache layout."""
    from pdserve.engine.loader import load_model, weight_files

    device, dtype = torch.device(config.device), DTYPES[config.dtype]
    loaded = loaded or load_model(config.model, dtype=config.dtype)
    model_config: ModelConfig = loaded.model_config
    state = loaded.load_state_dict()
    mode, linears = quantize(config, loaded, state)
    config = dataclasses.replace(config, quantization=mode)
    model = CausalLM(model_config, state, device, dtype, mode, linears)
    del state
    max_model_len = min(config.scheduler.max_model_len or model_config.max_position_embeddings,
                        model_config.max_position_embeddings)
    cache = cache_config(config.cache, model_config)
    kv = KVCacheManager(model_config, cache, device)
    layout = KVCacheLayout(
        model_name=loaded.name, num_layers=model_config.num_layers, num_blocks=kv.num_blocks,
        block_size=kv.block_size, num_kv_heads=model_config.num_kv_heads, head_dim=model_config.head_dim,
        dtype=cache.dtype, weights=kv_weights(mode), attention_window=cache.attention_window or 0,
        weights_fingerprint=weights_fingerprint(weight_files(loaded.model_dir)))
    connector = Connector() if connector is None else connector
    connector = connector if isinstance(connector, Connector) else connector(layout)
    connector.worker.register_kv_caches(kv.kv_caches, layout)
    connector.worker.register_block_pool(kv)
    spec = config.speculative
    speculator = Speculator(spec, kv) if spec is not None else NO_SPECULATION
    _log_ready(config, loaded.name, device, kv, max_model_len)
    return EngineParts(config, loaded, model, max_model_len, kv, layout, connector, speculator)


def cache_config(cache: CacheConfig, model: ModelConfig) -> CacheConfig:
    """`cache` with the architecture's sliding window as its attention window (when the
    configured one is wider or unset): blocks older than the window are never read."""
    if model.sliding_window and (cache.attention_window is None or cache.attention_window > model.sliding_window):
        return dataclasses.replace(cache, attention_window=model.sliding_window)
    return cache


def _log_ready(config: EngineConfig, name: str, device: torch.device, kv: KVCacheManager,
               max_model_len: int) -> None:
    kv_tokens = (kv.num_blocks - 1) * kv.block_size
    kv_gib = sum(t.numel() * t.element_size() for t in kv.kv_caches) / 2**30
    log.info("engine ready: model %s (%s, %s), KV cache %.2f GiB = %d tokens in blocks of %d, "
             "max_model_len %d: room for %.1f requests at full length, more when shorter",
             name, config.dtype, device, kv_gib, kv_tokens, kv.block_size, max_model_len,
             kv_tokens / max_model_len)

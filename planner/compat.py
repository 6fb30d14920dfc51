"""The KV compatibility hash of a model as an engine serving it would compute it
(`LLMEngine.compat_hash`), without building the engine: its config and weights' fingerprint
only. `pdserve plan --model` checks a profile against it."""
from __future__ import annotations

from pdserve.engine.config import kv_weights
from pdserve.engine.connector import KVCacheLayout


def model_compat_hash(model: str, dtype: str = "float32", block_size: int = 16, quantization: str = "auto",
                      attention_window: int | None = None) -> str:
    """Hex of the hash a worker with these settings computes for `model` (a quantization that
    leaves the KV as float32 weights compute it, `auto` and `gguf`, hashes as none)."""
    from pdserve.engine.fingerprint import weights_fingerprint
    from pdserve.engine.loader import load_model, weight_files

    loaded = load_model(model, dtype=dtype)
    config = loaded.model_config
    window = attention_window
    if config.sliding_window and (window is None or window > config.sliding_window):
        window = config.sliding_window
    layout = KVCacheLayout(
        model_name=loaded.name, num_layers=config.num_layers, num_blocks=1, block_size=block_size,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype,
        weights=kv_weights("" if quantization in ("auto", "none") else quantization),
        attention_window=window or 0, weights_fingerprint=weights_fingerprint(weight_files(loaded.model_dir)))
    return hash_hex(layout.compatibility_hash())


def hash_hex(value: int) -> str:
    return f"{value & (2**64 - 1):016x}"

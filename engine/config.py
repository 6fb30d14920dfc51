"""Typed, frozen configuration. Validated once at construction, then passed down."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pdserve.common.block_hash import INSECURE_KEY
from pdserve.common.errors import InvalidRequestError


class CapacityPolicy(str, enum.Enum):
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"  # admit only what can run to completion
    MAX_UTILIZATION = "MAX_UTILIZATION"  # pack; preempt (by recompute) when the cache is full
    STATIC_BATCH = "STATIC_BATCH"  # admit a batch, run it to the end, then the next


class ChunkingPolicy(str, enum.Enum):
    FIRST_COME_FIRST_SERVED = "FIRST_COME_FIRST_SERVED"  # finish the oldest prompt first
    EQUAL_PROGRESS = "EQUAL_PROGRESS"  # share the token budget evenly among prompts
    # A prompt ahead of those with at least twice its tokens left, in a step no larger than
    # 1.25x it: a short prompt behind a long one is not slowed by it (the long one gets what
    # is left); similar prompts keep their order.
    SHORTEST_FIRST = "SHORTEST_FIRST"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a decoder-only transformer, derived from a transformers config."""

    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # sorted items of the HF rope_scaling dict
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # attention window of the architecture (Mistral)
    name: str = ""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise InvalidRequestError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @classmethod
    def from_hf(cls, hf_config: Any, name: str = "") -> "ModelConfig":
        model_type = getattr(hf_config, "model_type", "llama")
        arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(model_type)
        if arch is None:
            from pdserve.common.errors import ModelLoadError
            raise ModelLoadError(f"unsupported model_type {model_type!r} (llama, mistral, qwen2, qwen3)")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        rope_scaling = getattr(hf_config, "rope_scaling", None) or {}
        # transformers 5 keeps rope settings in `rope_parameters` (theta + scaling together).
        rope_params = getattr(hf_config, "rope_parameters", None) or {}
        theta = rope_params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        if not rope_scaling and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling.get("rope_type", rope_scaling.get("type", "default")) == "default":
            rope_scaling = {}
        rope_scaling = {k: v for k, v in rope_scaling.items() if k != "rope_theta"}
        window = getattr(hf_config, "sliding_window", None)
        if model_type == "qwen2" or model_type == "qwen3":
            window = window if getattr(hf_config, "use_sliding_window", False) else None
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", 2048),
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=tuple(sorted((k, _freeze(v)) for k, v in rope_scaling.items())),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=arch == "qwen3",
            eos_token_ids=eos_ids,
            sliding_window=int(window) if window else None,
            name=name,
        )


def _freeze(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """How the paged KV cache is sized and laid out.

    Per layer the cache is one tensor `[num_blocks, 2, block_size, num_kv_heads, head_dim]`
    (index 0 on dim 1 = K, 1 = V). Sizing: the smaller of `max_tokens` and
    `free_memory_fraction` of the memory that is free after the weights (on CPU: the OS's
    available memory).
    """

    block_size: int = 16
    max_tokens: int | None = None
    free_memory_fraction: float = 0.9
    num_blocks: int | None = None  # explicit override (tests); wins over both above
    attention_window: int | None = None  # keep only the last W tokens' blocks
    enable_prefix_caching: bool = True
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise InvalidRequestError(f"block_size {self.block_size} must be 8, 16, 32, 64 or 128")
        if not 0.0 < self.free_memory_fraction <= 1.0:
            raise InvalidRequestError("free_memory_fraction must be in (0, 1]")
        if self.max_tokens is not None and self.max_tokens < self.block_size:
            raise InvalidRequestError("max_tokens must hold at least one block")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise InvalidRequestError("num_blocks must be >= 1")
        if self.attention_window is not None and self.attention_window < 1:
            raise InvalidRequestError("attention_window must be >= 1")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise InvalidRequestError(f"unsupported cache dtype {self.dtype!r}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    capacity_policy: CapacityPolicy = CapacityPolicy.GUARANTEED_NO_EVICT
    chunking_policy: ChunkingPolicy = ChunkingPolicy.FIRST_COME_FIRST_SERVED
    max_num_tokens: int = 2048  # tokens computed in one step (prefill chunks + decodes)
    max_batch_size: int = 64  # sequences in one step
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacity_policy", CapacityPolicy(self.capacity_policy))
        object.__setattr__(self, "chunking_policy", ChunkingPolicy(self.chunking_policy))
        if self.max_num_tokens < 1 or self.max_batch_size < 1:
            raise InvalidRequestError("max_num_tokens and max_batch_size must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequestError("max_model_len must be >= 2")


SPECULATIVE_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding by prompt lookup (`engine.speculation`), in vLLM's terms: up to
    `num_speculative_tokens` drafts per step, copied from after the latest earlier occurrence
    of the sequence's last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`.
    No speculation while `disable_by_batch_size` or more sequences decode (0: no such limit)."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int = 0

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidRequestError(f"speculative method {self.method!r} is not supported (ngram)")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidRequestError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise InvalidRequestError("need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64")
        if self.disable_by_batch_size < 0:
            raise InvalidRequestError("disable_by_batch_size must be >= 0")

    @classmethod
    def from_json(cls, text: str) -> "SpeculativeConfig | None":
        """vLLM's `--speculative-config` JSON for the ngram method; "" is no speculation. A
        missing `prompt_lookup_min` is 2 (at most `prompt_lookup_max`); unknown keys are refused."""
        import json

        if not text.strip():
            return None
        try:
            values = json.loads(text)
        except ValueError as exc:
            raise InvalidRequestError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(values, dict):
            raise InvalidRequestError("--speculative-config must be a JSON object")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "disable_by_batch_size"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidRequestError(f"--speculative-config: unsupported keys {unknown} "
                                      f"(pdserve takes {sorted(known)})")
        if "num_speculative_tokens" not in values:
            raise InvalidRequestError("--speculative-config needs num_speculative_tokens")
        if not all(isinstance(v, int) and not isinstance(v, bool) for k, v in values.items() if k != "method"):
            raise InvalidRequestError("--speculative-config: every value but method is an integer")
        high = values.get("prompt_lookup_max", 4)
        values.setdefault("prompt_lookup_max", high)
        values.setdefault("prompt_lookup_min", min(2, high))
        return cls(**values)


MAX_LORAS = 256
MAX_LORA_RANK = 512
QUANTIZATIONS = ("", "int8", "gguf", "gguf-fast", "gguf-int8dot", "gguf-int16dot", "auto")


def kv_weights(quantization: str) -> str:
    """The part of a quantization that changes the KV a model computes (the compatibility
    hash's `weights`): exact GGUF blocks expand to the float32 weights bit for bit, so a
    `gguf` worker and a float32 one exchange KV; int8 and gguf-fast compute other numbers."""
    return "" if quantization == "gguf" else quantization


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "default"  # "default" | a transformers directory | a .gguf file
    dtype: str = "float32"  # weights and activations
    device: str = "cpu"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    use_build_cache: bool = True
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    # "" (float32 weights) | "int8" (CPU, fp32: dynamic int8 GEMMs) | "gguf" (a GGUF model's own
    # blocks, float32 activations) | "gguf-fast" (the same, bfloat16 activations for 4-bit
    # blocks) | "gguf-int8dot" / "gguf-int16dot" (the same, 8- or 16-bit activations and integer
    # dot products in decode-sized steps) | "auto" ("gguf" for a GGUF model on CPU in float32, else "")
    quantization: str = ""
    # the key of the prompt blocks' digests (security.secret.block_hash_key): secret-derived
    # in a deployment with a cluster secret; never shown in a repr
    block_hash_key: bytes = field(default=INSECURE_KEY, repr=False)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    # LoRA (engine.lora): adapters in the device slots one step may mix, their highest rank,
    # adapters kept in memory (None: max_loras; at least max_loras), and the directory every
    # adapter path must be under (None: any path)
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_allowed_root: str | None = None

    def __post_init__(self) -> None:
        self._check_lora()
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise InvalidRequestError(f"unsupported dtype {self.dtype!r}")
        if self.quantization == "none":  # the flag's name for no quantization
            object.__setattr__(self, "quantization", "")
        if self.quantization not in QUANTIZATIONS:
            raise InvalidRequestError(f"unsupported quantization {self.quantization!r} "
                                      f"(none, {', '.join(q for q in QUANTIZATIONS if q)})")
        if self.quantization not in ("", "auto") and (self.device != "cpu" or self.dtype != "float32"):
            raise InvalidRequestError(f"--quantization {self.quantization} runs on CPU with float32 "
                                      f"activations only")

    def _check_lora(self) -> None:
        if not 1 <= self.max_loras <= MAX_LORAS:
            raise InvalidRequestError(f"max_loras must be in [1, {MAX_LORAS}]")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise InvalidRequestError(f"max_lora_rank must be in [1, {MAX_LORA_RANK}]")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise InvalidRequestError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                                      f"({self.max_loras})")

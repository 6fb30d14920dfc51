"""Fixtures every test may use. Component-specific fixtures live beside their tests."""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests import `support`, `kvcaches`
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))  # and the examples they run

# Keep torch to the machine's 2 cores and tests reproducible.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pick_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def free_port() -> int:
    return pick_free_port()


TINY_ARCHS = ("llama", "qwen2", "qwen3")


def make_tiny_model_dir(root: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random-weight transformers model of `arch`, saved as safetensors + config.json.

    Small enough to build in well under a second; GQA (4 query heads over 2 KV heads).
    No tokenizer: tests feed token ids.
    """
    import torch
    import transformers

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
    elif arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, **common)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; widen it so greedy choices are not near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    path = root / f"tiny-{arch}-{seed}"
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    made: dict[tuple, Path] = {}

    def factory(arch: str = "llama", seed: int = 0, **overrides) -> Path:
        key = (arch, seed, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = make_tiny_model_dir(tmp_path_factory.mktemp("models"), arch, seed, **overrides)
        return made[key]

    return factory

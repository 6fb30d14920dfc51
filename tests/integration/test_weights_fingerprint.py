"""The KV compatibility hash carries a fingerprint of the weights: two checkpoints of one
architecture under one served name (a swapped model, a fine-tune) get different hashes, so
KV records one stored are misses for the other; the same files give the same hash on every
load. Real engines over tiny random-weight checkpoints, a real disk store."""
from __future__ import annotations

import os

import pytest
import torch
from kvcaches import message_from_cache

from pdserve.engine.fingerprint import weights_fingerprint
from pdserve.engine.llm import LLM
from pdserve.engine.loader import weight_files
from pdserve.kvtransfer.backends.disk import DiskStore
from pdserve.kvtransfer.sink import limits_for

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def save_tiny(path, seed: int, only_layer: int | None = None):
    """A tiny Llama checkpoint at `path` (its directory name is the served name). With
    `only_layer`, weights of seed 1 except that layer's attention (a merged adapter)."""
    import transformers

    torch.manual_seed(1 if only_layer is not None else seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY), dtype=torch.float32)
    if only_layer is not None:
        torch.manual_seed(seed)
        with torch.no_grad():
            model.model.layers[only_layer].self_attn.v_proj.weight.normal_(0.0, 0.02)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("swapped")
    return (save_tiny(root / "a" / "tiny", seed=1), save_tiny(root / "b" / "tiny", seed=2),
            save_tiny(root / "c" / "tiny", seed=3, only_layer=1))


def engine(path):
    return LLM(str(path), num_blocks=8, block_size=16).engine


def test_a_swapped_model_under_the_same_name_has_another_compatibility_hash(checkpoints, tmp_path):
    first, swapped, adapted = (engine(p) for p in checkpoints)
    assert first.model_name == swapped.model_name == adapted.model_name == "tiny"
    assert len({first.compat_hash, swapped.compat_hash, adapted.compat_hash}) == 3
    assert engine(checkpoints[0]).compat_hash == first.compat_hash  # the same files, the same hash

    # a record stored by the first model is a miss for the swapped one, a hit for itself
    store = DiskStore(tmp_path / "store", mac_key=os.urandom(32))
    message = message_from_cache(first.kv.kv_caches, first.layout, os.urandom(16), [1], [0xFFFFFFFF], [42])
    assert store.put([42], message) == 1
    assert store.get([42], limits_for(swapped.layout)) == [None]
    assert store.get([42], limits_for(first.layout))[0] is not None


def test_the_fingerprint_reads_a_bounded_sample(checkpoints, monkeypatch):
    files = weight_files(checkpoints[0])
    read = []
    real_open = open

    class Counting:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def seek(self, offset):
            self.f.seek(offset)

        def read(self, n):
            data = self.f.read(n)
            read.append(len(data))
            return data

    monkeypatch.setattr("builtins.open", lambda path, mode="r", *a, **k: Counting(real_open(path, mode, *a, **k)))
    weights_fingerprint(files)
    assert sum(read) <= len(files) * ((1 << 20) + 64 * 4096)

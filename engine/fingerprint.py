"""A fingerprint of a model's weights for the KV compatibility hash: KV computed by other
weights must never be accepted, even under the same model name (a fine-tune, a re-upload).

Cheap at load and deterministic: SHA-256 over each weight file's base name, size, first MiB
(a safetensors header: every tensor's name, dtype, shape and offsets) and 64 evenly spaced
4 KiB samples of the rest. A model that differs in any tensor's metadata, or in the bytes of
tensors that make up more than a few percent of the file (a fine-tune, merged adapters),
changes it; reading ~1.3 MiB per file costs milliseconds whatever the model's size. Two
workers must load byte-identical files (the same checkpoint, or the same GGUF converted by
the same pdserve) to share KV; different files of equal weights only cost a fallback.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

HEAD_BYTES = 1 << 20
NUM_SAMPLES = 64
SAMPLE_BYTES = 4096


def weights_fingerprint(files: Iterable[Path]) -> str:
    """Hex fingerprint (128 bits) of the weight `files`, in name order."""
    digest = hashlib.sha256(b"pdserve-weights-v1")
    for path in sorted(files, key=lambda p: p.name):
        size = os.path.getsize(path)
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            digest.update(f.read(HEAD_BYTES))
            span = max(0, size - SAMPLE_BYTES)
            for i in range(NUM_SAMPLES):
                f.seek(span * i // (NUM_SAMPLES - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:32]

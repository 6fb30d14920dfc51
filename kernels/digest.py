"""A keyed digest of a byte buffer computed where the buffer lives (GPU or CPU): what lets
a KV payload on a GPU be checked and MACed without copying it to the host.

The construction is NH (the universal hash inside UMAC) on 16-bit words, Toeplitz-iterated
over LANES lanes. The buffer is read as little-endian 32-bit words, each word a pair of
16-bit halves (lo, hi), in chunks of PAIRS words. For chunk c and lane j, with the key's
pairs (klo, khi)::

    digest[c, j] = sum over i < PAIRS of
                   ((lo[c, i] + klo[i + j]) mod 2^16) * ((hi[c, i] + khi[i + j]) mod 2^16)

computed exactly in int64 (each product < 2^32, the sum < 2^44; words past the end count
as 0). For a key drawn uniformly, two different chunks collide in one lane with probability
at most 2^-16, in all LANES lanes (the Toeplitz shift) at most 2^-(16 * LANES) = 2^-128.
`keyed_digest` applies it twice, the second time (under a second key) to the first one's
rows, and hands the host 64 bytes per 4 MiB of buffer; where the two buffers differ, their
first-level rows collide with probability at most 2^-128 and, if not, their second-level
rows at most 2^-128 again. The caller hashes or MACs those bytes: under a secret one-time
key (the transfer session's) that is a MAC of the buffer; under a public key a corruption
check only.

The buffer's length is not in the digest (trailing zero words are invisible): callers bind
it separately (the KV wire header carries it).
"""
from __future__ import annotations

import functools
import hashlib

import numpy as np
import torch

from pdserve.kernels.checks import require
from pdserve.kernels.dispatch import use_triton

PAIRS = 4096  # 32-bit words per chunk: 16 KiB of payload per digest row
LANES = 8  # Toeplitz lanes: 16 bits of collision resistance each
KEY_PAIRS = PAIRS + LANES - 1
_TORCH_SLICE = 64  # chunks per pass of the torch path (bounds its int64 temporaries)


def digest_key(secret: bytes, device: torch.device | str = "cpu") -> torch.Tensor:
    """The key `[2, KEY_PAIRS]` (int64 values in [0, 2^16): row 0 for the low halves, row 1
    for the high ones) expanded from `secret` with SHAKE-256."""
    raw = hashlib.shake_256(b"pdserve-nh16\x00" + secret).digest(4 * KEY_PAIRS)
    words = np.frombuffer(raw, dtype="<u2").astype(np.int64).reshape(2, KEY_PAIRS)
    return torch.from_numpy(words).to(device)


@functools.lru_cache(maxsize=8)
def _level_key(secret: bytes, level: int, device: str) -> torch.Tensor:
    return digest_key(secret + bytes([level]), device)


def keyed_digest(payload: torch.Tensor, secret: bytes, cache_key: bool = False) -> bytes:
    """The two-level digest of a tensor's bytes under keys from `secret`, as host bytes
    (64 per 4 MiB of payload, at least 64). `cache_key`: keep the expanded keys (a public
    secret used for every message)."""
    device = str(payload.device)
    keys = [_level_key(secret, level, device) if cache_key else digest_key(secret + bytes([level]), device)
            for level in (0, 1)]
    rows = payload_digest(payload_digest(payload, keys[0]), keys[1])
    return rows.cpu().numpy().tobytes()


def num_chunks(nbytes: int) -> int:
    return -(-nbytes // (4 * PAIRS))


def payload_digest(payload: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The digest `[num_chunks, LANES]` (int64, on `payload`'s device) of a contiguous
    tensor's bytes, whose length must be a multiple of 4. `key`: `digest_key(...)`, on the
    same device. Triton on CUDA, torch elsewhere (see `dispatch`)."""
    require(isinstance(payload, torch.Tensor) and payload.is_contiguous(), "payload must be a contiguous tensor")
    words = payload.detach().reshape(-1).view(torch.uint8)
    require(words.numel() % 4 == 0, f"payload of {words.numel()} bytes: the digest reads 32-bit words")
    require(tuple(key.shape) == (2, KEY_PAIRS) and key.dtype == torch.int64, "key must be digest_key(...)")
    require(key.device == payload.device, f"key on {key.device}, payload on {payload.device}")
    words = words.view(torch.int32)
    if use_triton(words.device):
        from pdserve.kernels import triton_digest

        return triton_digest.payload_digest(words, key)
    return _torch_digest(words, key)


def _torch_digest(words: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    n = words.numel()
    chunks = num_chunks(4 * n)
    out = torch.empty((chunks, LANES), dtype=torch.int64, device=words.device)
    lanes_lo = torch.stack([key[0, j:j + PAIRS] for j in range(LANES)])  # [LANES, PAIRS]
    lanes_hi = torch.stack([key[1, j:j + PAIRS] for j in range(LANES)])
    for first in range(0, chunks, _TORCH_SLICE):
        stop = min(chunks, first + _TORCH_SLICE)
        part = words[first * PAIRS:stop * PAIRS].to(torch.int64) & 0xFFFFFFFF
        if part.numel() < (stop - first) * PAIRS:  # the last chunk, short: zero words
            part = torch.nn.functional.pad(part, (0, (stop - first) * PAIRS - part.numel()))
        part = part.view(stop - first, 1, PAIRS)
        lo = (part & 0xFFFF) + lanes_lo  # [S, LANES, PAIRS]
        hi = (part >> 16) + lanes_hi
        out[first:stop] = ((lo & 0xFFFF) * (hi & 0xFFFF)).sum(dim=-1)
    return out


def reference_digest(data: bytes, secret: bytes) -> list[list[int]]:
    """Loop-by-loop digest of `data` under `digest_key(secret)` (tests; small inputs)."""
    key = digest_key(secret).tolist()
    words = list(np.frombuffer(data, dtype="<u4"))
    rows = []
    for c in range(num_chunks(len(data))):
        chunk = words[c * PAIRS:(c + 1) * PAIRS]
        chunk += [0] * (PAIRS - len(chunk))
        rows.append([sum((((int(w) & 0xFFFF) + key[0][i + j]) % 65536) * (((int(w) >> 16) + key[1][i + j]) % 65536)
                         for i, w in enumerate(chunk)) for j in range(LANES)])
    return rows

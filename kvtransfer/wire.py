"""The KV wire format: a fixed binary header, an index section, then raw tensor bytes.

    offset  size  field
    0       4     magic b"PDKV"
    4       2     format version (2)
    6       1     dtype code (DTYPE_CODES)
    7       1     flags: 0, or FLAG_DEVICE_DIGEST (the checksum covers the payload's digest)
    8       8     compatibility hash, int64 (KVCacheLayout.compatibility_hash)
    16      16    transfer id (16 raw bytes, a uuid)
    32      4     num_blocks N
    36      2     num_layers L (of the model: the layout)
    38      2     block_size BS
    40      2     num_kv_heads H
    42      2     head_dim D
    44      2     first layer F of the slice this message carries
    46      2     layers in the slice S (F + S <= L; a whole block: F = 0, S = L)
    48      4     reserved, 0
    52      8     payload length in bytes = N * S * 2 * BS * H * D * itemsize
    60      8     checksum: xxh64 of index section + payload (+ digest, see below)
    68      4     crc32 of bytes [0, 68)
    -- 72 bytes; then the index section, N entries of 16 bytes:
    +0      4     destination block id (uint32; 0xFFFFFFFF = none, content-addressed stores)
    +4      4     reserved, 0
    +8      8     block hash (int64; 0 = none)
    -- then the payload: N blocks, block-major [N, S, 2, BS, H, D] (kernels.gather_blocks).

A message carries layers [F, F + S) of its blocks: a whole-block message all of them, a
streamed one (layer-wise transfer, `connector_worker._Stream`) one layer of one prefill
chunk's blocks. Store records are always whole blocks.

A payload that lives on a GPU (the nccl backend's device-direct path) is not read by the
host: its header sets FLAG_DEVICE_DIGEST and the checksum is xxh64 of the index section and
of the payload's NH digest under a public key (`kernels.digest.keyed_digest`, computed on the
GPU; 64 bytes per 4 MiB go to the host). A receiver verifies whichever the header names, wherever
the payload landed.

The checksum (keyless xxh64) and the crc catch corruption, not an attacker, who could
recompute both: against tampering, a point-to-point transfer's frames and payloads carry
HMAC-SHA256 tags under a key fresh per control connection (`backends._p2p.Session`), and
store records a MAC under the store key (`codec`).

All integers little-endian. Nothing here is pickled. Every field a peer sends is checked
against `WireLimits` (what the receiver expects) BEFORE anything is allocated or indexed.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import xxhash

from pdserve.common.errors import TransferError

MAGIC = b"PDKV"
FORMAT_VERSION = 2
HEADER = struct.Struct("<4sHBBq16sIHHHHHHIQQI")
HEADER_SIZE = HEADER.size  # 72
_CRC_AT = HEADER_SIZE - 4
INDEX_ENTRY = struct.Struct("<IIq")
INDEX_ENTRY_SIZE = INDEX_ENTRY.size  # 16
NO_BLOCK = 0xFFFFFFFF
FLAG_DEVICE_DIGEST = 0x01
_PUBLIC_DIGEST_KEY = b"pdserve-kv-checksum"  # corruption check only: anyone may compute it

DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}

assert HEADER_SIZE == 72 and INDEX_ENTRY_SIZE == 16


class WireError(TransferError):
    """A message was refused: malformed, corrupt, incompatible or over a limit."""


@dataclass(frozen=True, slots=True)
class BlockHeader:
    transfer_id: bytes
    compat_hash: int
    dtype: str
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    payload_len: int
    checksum: int
    first_layer: int = 0
    layer_count: int = 0  # 0: num_layers (a whole block)
    device_digest: bool = False  # the checksum covers the payload's digest (FLAG_DEVICE_DIGEST)

    @property
    def layers(self) -> range:
        """The layers this message carries."""
        return range(self.first_layer, self.first_layer + (self.layer_count or self.num_layers))

    @property
    def is_whole(self) -> bool:
        return len(self.layers) == self.num_layers

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across the layers this message carries."""
        return (len(self.layers) * 2 * self.block_size * self.num_kv_heads * self.head_dim
                * ITEMSIZE[self.dtype])

    @property
    def index_len(self) -> int:
        return self.num_blocks * INDEX_ENTRY_SIZE


@dataclass(frozen=True, slots=True)
class WireLimits:
    """What a receiver accepts. A header that disagrees with any field is refused."""

    compat_hash: int
    dtype: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    max_blocks: int  # most blocks in one message (and the receiver's pool size)


def payload_nbytes(num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int,
                   head_dim: int, dtype: str) -> int:
    return num_blocks * num_layers * 2 * block_size * num_kv_heads * head_dim * ITEMSIZE[dtype]


def checksum(index: bytes | memoryview, payload: bytes | memoryview) -> int:
    h = xxhash.xxh64()
    h.update(index)
    h.update(payload)
    return h.intdigest()


def is_device_payload(payload: object) -> bool:
    """A tensor outside host memory: its checksum is taken over its digest, on its device."""
    return hasattr(payload, "element_size") and payload.device.type != "cpu"


def digest_checksum(index: bytes | memoryview, payload) -> int:
    """The FLAG_DEVICE_DIGEST checksum of a payload tensor (any device; host bytes are
    viewed as a tensor)."""
    from pdserve.kernels import digest
    from pdserve.kvtransfer.blocks import bytes_tensor

    if not hasattr(payload, "element_size"):
        payload = bytes_tensor(payload)
    return checksum(index, digest.keyed_digest(payload, _PUBLIC_DIGEST_KEY, cache_key=True))


def encode_index(dst_block_ids, block_hashes) -> bytes:
    if len(dst_block_ids) != len(block_hashes):
        raise ValueError("dst_block_ids and block_hashes differ in length")
    return b"".join(INDEX_ENTRY.pack(int(b), 0, int(h)) for b, h in zip(dst_block_ids, block_hashes))


def encode_header(*, transfer_id: bytes, compat_hash: int, dtype: str, num_blocks: int,
                  num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                  index: bytes, payload, layers: range | None = None, digest: bool | None = None) -> bytes:
    """The header for `index` + `payload` (already laid out as documented above: bytes, or
    a tensor); `layers`: the slice carried (default all `num_layers`); `digest`: whether the
    checksum covers the payload's digest (FLAG_DEVICE_DIGEST; None: exactly when the
    payload is on a GPU, which the host never reads)."""
    if len(transfer_id) != 16:
        raise ValueError("transfer_id must be 16 bytes")
    layers = range(num_layers) if layers is None else layers
    if not (len(layers) and 0 <= layers.start and layers.stop <= num_layers and layers.step == 1):
        raise ValueError(f"layers {layers} is not a slice of {num_layers} layers")
    expected = payload_nbytes(num_blocks, len(layers), block_size, num_kv_heads, head_dim, dtype)
    on_device = is_device_payload(payload)
    nbytes = payload.numel() * payload.element_size() if on_device else len(payload)
    if nbytes != expected or len(index) != num_blocks * INDEX_ENTRY_SIZE:
        raise ValueError(f"payload {nbytes} B / index {len(index)} B do not match the shape")
    if on_device and digest is False:
        raise ValueError("a payload on a GPU takes the digest checksum")
    if on_device or digest:
        flags, csum = FLAG_DEVICE_DIGEST, digest_checksum(index, payload)
    else:
        flags, csum = 0, checksum(index, payload)
    body = HEADER.pack(MAGIC, FORMAT_VERSION, DTYPE_CODES[dtype], flags, compat_hash, transfer_id,
                       num_blocks, num_layers, block_size, num_kv_heads, head_dim,
                       layers.start, len(layers), 0, nbytes, csum, 0)
    return body[:_CRC_AT] + struct.pack("<I", zlib.crc32(body[:_CRC_AT]))


def declared_payload_len(header: bytes) -> int:
    """The payload length a header we built ourselves declares (no checks)."""
    return HEADER.unpack(header[:HEADER_SIZE])[14]


def parse_header(data: bytes | memoryview, limits: WireLimits) -> BlockHeader:
    """Parse and check a header. Raises WireError; never allocates based on peer values."""
    if len(data) < HEADER_SIZE:
        raise WireError(f"truncated header: {len(data)} of {HEADER_SIZE} bytes")
    raw = bytes(data[:HEADER_SIZE])
    (magic, version, dtype_code, flags, compat, transfer_id, num_blocks, num_layers, block_size,
     num_kv_heads, head_dim, first_layer, layer_count, reserved, payload_len, csum, crc) = HEADER.unpack(raw)
    if magic != MAGIC:
        raise WireError("bad magic: not a pdserve KV message")
    if zlib.crc32(raw[:_CRC_AT]) != crc:
        raise WireError("header checksum mismatch")
    if version != FORMAT_VERSION:
        raise WireError(f"unsupported wire format version {version} (this side speaks {FORMAT_VERSION})")
    if flags & ~FLAG_DEVICE_DIGEST or reserved != 0:
        raise WireError(f"unknown flags {flags:#x} / reserved bits {reserved:#x}")
    dtype = DTYPE_NAMES.get(dtype_code)
    if dtype is None:
        raise WireError(f"unknown dtype code {dtype_code}")
    if compat != limits.compat_hash:
        raise WireError(f"compatibility hash mismatch: peer {compat:#x}, ours {limits.compat_hash:#x}")
    got = (dtype, num_layers, block_size, num_kv_heads, head_dim)
    want = (limits.dtype, limits.num_layers, limits.block_size, limits.num_kv_heads, limits.head_dim)
    if got != want:
        raise WireError(f"layout mismatch: peer {got}, ours {want}")
    if not 0 < num_blocks <= limits.max_blocks:
        raise WireError(f"num_blocks {num_blocks} outside 1..{limits.max_blocks}")
    if not (layer_count > 0 and first_layer + layer_count <= num_layers):
        raise WireError(f"layers [{first_layer}, {first_layer + layer_count}) outside the model's {num_layers}")
    expected = payload_nbytes(num_blocks, layer_count, block_size, num_kv_heads, head_dim, dtype)
    if payload_len != expected:
        raise WireError(f"payload length {payload_len} != {expected} implied by the shape")
    return BlockHeader(transfer_id, compat, dtype, num_blocks, num_layers, block_size,
                       num_kv_heads, head_dim, payload_len, csum, first_layer, layer_count,
                       bool(flags & FLAG_DEVICE_DIGEST))


def parse_index(header: BlockHeader, index: bytes | memoryview,
                num_pool_blocks: int | None) -> tuple[list[int], list[int]]:
    """(destination block ids, block hashes). With `num_pool_blocks`, every id must be a
    valid, distinct block of that pool; without it (stores) ids must be NO_BLOCK or valid."""
    if len(index) != header.index_len:
        raise WireError(f"index section is {len(index)} bytes, expected {header.index_len}")
    block_ids: list[int] = []
    hashes: list[int] = []
    for off in range(0, header.index_len, INDEX_ENTRY_SIZE):
        block_id, reserved, block_hash = INDEX_ENTRY.unpack_from(index, off)
        if reserved != 0:
            raise WireError("reserved index bytes are not zero")
        if num_pool_blocks is not None and block_id >= num_pool_blocks:
            raise WireError(f"destination block {block_id} outside the pool of {num_pool_blocks}")
        block_ids.append(block_id)
        hashes.append(block_hash)
    if num_pool_blocks is not None and len(set(block_ids)) != len(block_ids):
        raise WireError("duplicate destination block ids")
    return block_ids, hashes


def verify_payload(header: BlockHeader, index: bytes | memoryview, payload) -> None:
    """`payload`: host bytes, or a tensor on any device (a GPU one only under a
    FLAG_DEVICE_DIGEST header: its plain checksum would need every byte on the host)."""
    on_device = is_device_payload(payload)
    nbytes = payload.numel() * payload.element_size() if hasattr(payload, "element_size") else len(payload)
    if nbytes != header.payload_len:
        raise WireError(f"truncated payload: {nbytes} of {header.payload_len} bytes")
    if header.device_digest:
        got = digest_checksum(index, payload)
    elif on_device:
        raise WireError("a payload on a device under a header without FLAG_DEVICE_DIGEST")
    else:
        got = checksum(index, payload)
    if got != header.checksum:
        raise WireError("payload checksum mismatch")

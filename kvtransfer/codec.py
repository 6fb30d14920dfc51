"""Building and reading whole wire messages (wire.py holds the format and its checks).

* `encode_message`: header + index + payload for blocks gathered out of a cache.
* `split_records` / `decode_record`: the single-block records stores keep (one block across
  all layers each, self-checking: its own header, index entry and checksum; then the block's
  prefix digest (common.block_hash; zeros for a block without one), which a prefix-cache
  reader compares with its own before use, so a key collision is a miss; with the
  deployment's store key, the whole record sealed with an AEAD (encrypted and tagged) that a
  reader opens before trusting anything).
* `decode_message`: a complete message received as bytes, checked against `WireLimits`.
"""
from __future__ import annotations

import hmac
import logging
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

from pdserve.kvtransfer.base import BlockMessage
from pdserve.kvtransfer.wire import (
    DTYPE_NAMES, HEADER, HEADER_SIZE, INDEX_ENTRY, NO_BLOCK, BlockHeader, WireError, WireLimits,
    encode_header, encode_index, is_device_payload, parse_header, parse_index, verify_payload,
)
from pdserve.common.block_hash import DIGEST_BYTES, stable_hash64
from pdserve.security import store_records

NO_TRANSFER = bytes(16)  # transfer id of content-addressed records (shared by every transfer)

log = logging.getLogger(__name__)


def new_transfer_id() -> bytes:
    return uuid.uuid4().bytes


def ephemeral_key(transfer_id: bytes, index: int) -> int:
    """Store key of a block that has no content hash (a prompt's partial last block).

    Block hashes are non-negative (proto.block_hash masks them to 63 bits); these keys are
    negative, so a store can tell them apart and keep them only briefly.
    """
    return -1 - stable_hash64("pdkv-ephemeral", transfer_id, index)


def as_bytes_view(buf: object) -> memoryview:
    """A flat byte view of bytes / bytearray / memoryview / a contiguous CPU tensor (no copy).
    A tensor on a GPU is copied to the host (a device-direct send falling back to a store
    or a host transport)."""
    if hasattr(buf, "element_size"):  # a torch tensor
        import torch

        return memoryview(buf.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy())
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def encode_message(limits: WireLimits, transfer_id: bytes, dst_block_ids: Sequence[int],
                   block_hashes: Sequence[int], payload: object, layers: range | None = None,
                   digest: bool | None = None) -> BlockMessage:
    """`payload`: the blocks `[N, S, 2, BS, H, D]` as bytes or a contiguous tensor (a GPU one
    stays there: its checksum is its digest's, see `wire`), for the S layers of `layers`
    (default: all of them). `digest`: as `wire.encode_header`."""
    index = encode_index(dst_block_ids, block_hashes)
    view = payload if is_device_payload(payload) else as_bytes_view(payload)  # a GPU one stays there
    header = encode_header(
        transfer_id=transfer_id, compat_hash=limits.compat_hash, dtype=limits.dtype,
        num_blocks=len(dst_block_ids), num_layers=limits.num_layers,
        block_size=limits.block_size, num_kv_heads=limits.num_kv_heads,
        head_dim=limits.head_dim, index=index, payload=view, layers=layers, digest=digest)
    return BlockMessage(transfer_id, header, index, payload)


def layout_of(message: BlockMessage) -> WireLimits:
    """The layout a message we built ourselves declares (trusted: no checks)."""
    (_, _, dtype_code, _, compat, _, num_blocks, num_layers, block_size, num_kv_heads,
     head_dim, _, layer_count, _, _, _, _) = HEADER.unpack(message.header[:HEADER_SIZE])
    if layer_count != num_layers:
        raise ValueError(f"a message of {layer_count} of {num_layers} layers is not whole blocks")
    return WireLimits(compat, DTYPE_NAMES[dtype_code], num_layers, block_size, num_kv_heads,
                      head_dim, max_blocks=num_blocks)


NO_DIGEST = bytes(DIGEST_BYTES)  # the digest slot of a record whose block has none


def split_records(message: BlockMessage, keys: Sequence[int], mac_key: bytes | None = None,
                  digests: Sequence[bytes] = ()) -> list[bytes]:
    """One self-checking single-block record per block of `message`, block i under keys[i]
    with digests[i] (NO_DIGEST where `digests` is shorter). With `mac_key` (the deployment's
    store key) each record is encrypted and tagged under its key (`security.store_records`),
    so the store holds none of its bytes in clear and only a holder of the cluster secret
    can write a record a service will load."""
    layout = layout_of(message)
    if len(keys) != layout.max_blocks:
        raise ValueError(f"{len(keys)} keys for {layout.max_blocks} blocks")
    if any(len(d) != DIGEST_BYTES for d in digests):
        raise ValueError(f"a block digest is {DIGEST_BYTES} bytes")
    view = as_bytes_view(message.payload)
    block_nbytes = len(view) // max(1, layout.max_blocks)
    records = []
    for i, key in enumerate(keys):
        one = view[i * block_nbytes:(i + 1) * block_nbytes]
        index = INDEX_ENTRY.pack(NO_BLOCK, 0, int(key))
        header = encode_header(
            transfer_id=NO_TRANSFER, compat_hash=layout.compat_hash, dtype=layout.dtype,
            num_blocks=1, num_layers=layout.num_layers, block_size=layout.block_size,
            num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, index=index, payload=one)
        record = b"".join((header, index, one, digests[i] if i < len(digests) else NO_DIGEST))
        records.append(store_records.seal(mac_key, key, record))
    return records


def record_nbytes(limits: WireLimits, keyed: bool = False) -> int:
    """Size of one single-block record of this layout (sealed: with its nonce and tag, when `keyed`)."""
    from pdserve.kvtransfer.wire import INDEX_ENTRY_SIZE, payload_nbytes

    return HEADER_SIZE + INDEX_ENTRY_SIZE + payload_nbytes(
        1, limits.num_layers, limits.block_size, limits.num_kv_heads, limits.head_dim,
        limits.dtype) + DIGEST_BYTES + store_records.sealed_overhead(keyed)


class UnauthenticatedRecord(WireError):
    """A store record whose seal fails: planted, altered, or from another deployment."""


class DigestMismatch(WireError):
    """A store record under the right key whose block digest is not the reader's: another
    prefix's block (a key collision), or one stored without a digest."""


def decode_record(data: bytes | memoryview, limits: WireLimits, key: int,
                  mac_key: bytes | None = None, digest: bytes | None = None) -> memoryview:
    """The payload of a single-block record stored under `key`. With `mac_key`, the record
    is opened (decrypted, its tag checked) first (UnauthenticatedRecord); with `digest`, the block's digest must be
    it (DigestMismatch). Raises WireError."""
    view = memoryview(data)
    if mac_key is not None:
        view = store_records.open_sealed(mac_key, key, view)
        if view is None:
            raise UnauthenticatedRecord(f"record {key:#x} fails its seal")
    header = parse_header(view, limits)
    if header.num_blocks != 1 or not header.is_whole:
        raise WireError(f"a store record holds one whole block, not {header.num_blocks} of "
                        f"{len(header.layers)} layers")
    index_end = HEADER_SIZE + header.index_len
    payload_end = index_end + header.payload_len
    if len(view) != payload_end + DIGEST_BYTES:
        raise WireError(f"record is {len(view)} bytes, expected {payload_end + DIGEST_BYTES}")
    index = view[HEADER_SIZE:index_end]
    _, hashes = parse_index(header, index, None)
    if hashes[0] != key:
        raise WireError(f"record holds block {hashes[0]:#x}, not {key:#x}")
    if digest is not None and not hmac.compare_digest(bytes(view[payload_end:]), digest):
        raise DigestMismatch(f"record {key:#x} holds another prefix's block (digest differs)")
    payload = view[index_end:payload_end]
    verify_payload(header, index, payload)
    return payload


class RecordReads:
    """A store's reading of its records: the payload, or None for a record it must not use,
    counted (`num_unauthenticated`, `num_digest_mismatches`) and logged (a digest mismatch
    once: it is another prefix's block, kept for it; a record failing its MAC or corrupt is
    also dropped through `drop`)."""

    def __init__(self, store: str) -> None:
        self.store = store
        self.num_unauthenticated = 0
        self.num_digest_mismatches = 0
        self.num_corrupt = 0  # truncated or malformed records (dropped)

    def payload(self, data: bytes | memoryview, limits: WireLimits, key: int, mac_key: bytes | None,
                digest: bytes | None, name: object, drop: Callable[[], None]) -> memoryview | None:
        try:
            return decode_record(data, limits, key, mac_key, digest)
        except DigestMismatch as exc:  # another prefix's block under a colliding key: kept for it
            self.num_digest_mismatches += 1
            if self.num_digest_mismatches == 1:
                log.warning("%s: refusing record %s: %s (logged once)", self.store, name, exc)
        except UnauthenticatedRecord as exc:
            self.num_unauthenticated += 1
            log.warning("%s: refusing record %s: %s", self.store, name, exc)
            drop()
        except WireError as exc:
            self.num_corrupt += 1
            log.warning("%s: dropping corrupt record %s: %s", self.store, name, exc)
            drop()
        return None


class CountsRecordReads:
    """A store's counts of the records its `_reads` (a RecordReads) refused."""

    _reads: RecordReads

    @property
    def num_unauthenticated(self) -> int:
        """Records refused for their MAC (and dropped)."""
        return self._reads.num_unauthenticated

    @property
    def num_digest_mismatches(self) -> int:
        """Records under a matching key holding another prefix's block (kept)."""
        return self._reads.num_digest_mismatches

    @property
    def num_corrupt(self) -> int:
        """Records truncated or malformed (dropped)."""
        return self._reads.num_corrupt


@dataclass(frozen=True, slots=True)
class DecodedMessage:
    header: BlockHeader
    index: memoryview
    block_ids: list[int]
    block_hashes: list[int]
    payload: memoryview


def decode_message(data: bytes | memoryview, limits: WireLimits,
                   num_pool_blocks: int | None) -> DecodedMessage:
    """Check a complete received message (header, index bounds, length, checksum)."""
    view = memoryview(data)
    header = parse_header(view, limits)
    index_end = HEADER_SIZE + header.index_len
    if len(view) < index_end:
        raise WireError(f"truncated index: {len(view)} of {index_end} bytes")
    index = view[HEADER_SIZE:index_end]
    block_ids, hashes = parse_index(header, index, num_pool_blocks)
    payload = view[index_end:]
    verify_payload(header, index, payload)
    return DecodedMessage(header, index, block_ids, hashes, payload)

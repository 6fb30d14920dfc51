"""The two kinds of backend behind the connector.

* `KVTransport`: point-to-point. The sender pushes one encoded message (wire.py) straight into
  a receiver, whose `BlockSink` checks it and scatters it into pre-allocated cache blocks.
  Backends: ucx, nccl.
* `BlockStore`: content-addressed. Blocks are put under their block hash and fetched by it by
  anyone with the same compatibility hash. Backends: redis, disk. A failing store counts as a
  miss, never as an error that fails a request.

Both are chosen by name (`backend_loader.py`) and import their heavy dependency only when chosen.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Protocol, Sequence

from pdserve.kvtransfer.health import BackendHealth
from pdserve.kvtransfer.wire import BlockHeader, WireLimits


@dataclass(frozen=True, slots=True)
class BlockMessage:
    """One encoded message: header (72 B) + index (16 B per block) + payload (raw bytes).

    `payload` is a contiguous buffer (bytes, memoryview, or a CPU/CUDA tensor viewed as
    uint8) laid out `[N, L, 2, BS, H, D]`, as `kernels.gather_blocks` produces it.
    """

    transfer_id: bytes
    header: bytes
    index: bytes
    payload: object

    @property
    def nbytes(self) -> int:
        return len(self.header) + len(self.index) + self.payload_nbytes

    @property
    def payload_nbytes(self) -> int:
        p = self.payload
        return p.numel() * p.element_size() if hasattr(p, "element_size") else len(p)


class BlockSink(Protocol):
    """The receiving side of a transport: owned by the connector, backed by the cache.

    Contract for transports: call `limits` / `check` on the header before receiving the
    payload; receive into `staging(header)` (a buffer of exactly payload_len bytes), then call
    `commit`. Any exception from these means: refuse the message, tell the sender, move on.
    """

    @property
    def limits(self) -> WireLimits: ...

    def check(self, header: BlockHeader, index: bytes) -> None:
        """Raise WireError/TransferError unless this transfer id is expected (not a duplicate,
        not aborted, not past its deadline) and the index names its reserved blocks."""

    def staging(self, header: BlockHeader, on_device: bool = False) -> object:
        """A writable contiguous buffer of header.payload_len bytes to receive into. With
        `on_device` (a transport that receives into GPU memory) a sink whose cache is on a
        GPU returns a tensor there; other sinks return host memory all the same."""

    def commit(self, header: BlockHeader, index: bytes, payload: object) -> None:
        """Verify the checksum and scatter into the destination blocks (`payload`: host bytes,
        or the tensor `staging` gave). Idempotence is the sink's job: a second commit of the
        same transfer id is refused."""


class KVTransport(abc.ABC):
    """Point-to-point transport. Thread-safe; every blocking call takes a deadline."""

    name: str = ""
    # True when the transport sends and receives GPU tensors as they are (no host staging):
    # a sender should hand it payloads on the GPU
    device_direct: bool = False

    @abc.abstractmethod
    def open_receiver(self, sink: BlockSink) -> str:
        """Start accepting messages into `sink`; return the endpoint string peers send to
        (e.g. "127.0.0.1:50100"). Binds 127.0.0.1 unless the backend was configured otherwise."""

    @abc.abstractmethod
    def send(self, endpoint: str, message: BlockMessage, deadline: float) -> None:
        """Deliver `message` to the receiver at `endpoint` and wait for its verdict.
        `deadline` is a `time.monotonic()` instant. Raises TransferError (refused by the
        receiver, peer unreachable) or TimeoutError (deadline passed)."""

    def prepare(self) -> None:
        """Start what every send needs (a context, its thread) now, off the first request's
        path. Called once, in the background, by a sender. Default: nothing to do."""

    def connect_ahead(self, endpoint: str, deadline: float) -> None:
        """Connect to the receiver at `endpoint` now, so a later `send` finds the connection
        open (the sender learns of a peer before it has anything to send). Blocks until
        connected or `deadline` (monotonic); raises like `send`. Default: nothing to do."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop listening, drop connections. Idempotent."""


class BlockStore(abc.ABC):
    """Content-addressed block store keyed by (compatibility hash, key).

    A key is a block's content hash (non-negative, `proto.block_hash`), or a negative
    short-lived key for a block without one (`codec.ephemeral_key`), which the store keeps
    only for a short TTL. Each record is a single-block wire message, so it checks itself.

    A store never fails a request: trouble (unreachable, full, unwritable, corrupt) is logged,
    counted in `health`, and reads as a miss / a short put. While `health` says unhealthy the
    store answers misses at once, until a probe after the cool-down succeeds.
    """

    name: str = ""
    health: BackendHealth

    @abc.abstractmethod
    def put(self, block_hashes: Sequence[int], message: BlockMessage, digests: Sequence[bytes] = ()) -> int:
        """Store block i of `message` under `block_hashes[i]` with its prefix digest
        `digests[i]` (none where `digests` is shorter: a transfer's blocks); the compatibility
        hash comes from the message header. Returns how many were stored. Never raises for
        backend trouble (logs, returns what it managed)."""

    @abc.abstractmethod
    def get(self, block_hashes: Sequence[int], limits: WireLimits,
            digests: Sequence[bytes] | None = None) -> list[memoryview | None]:
        """Payload of each block (one block across all layers, `[L, 2, BS, H, D]` bytes), or
        None for a miss. A corrupt or incompatible record is a miss (and is deleted). With
        `digests` (a prefix-cache lookup), record i must carry `digests[i]`: one that does not
        (another prefix's block under a colliding key, or a block stored without a digest) is
        a miss, counted in `num_digest_mismatches` and logged once."""

    @abc.abstractmethod
    def count_prefix_hits(self, block_hashes: Sequence[int], compat_hash: int) -> int:
        """Length of the longest prefix of `block_hashes` present in the store (0 on trouble)."""

    @abc.abstractmethod
    def discard(self, block_hashes: Sequence[int], compat_hash: int) -> None:
        """Delete these records if present (used for short-lived keys once fetched)."""

    @abc.abstractmethod
    def probe(self) -> bool:
        """A cheap call that tells whether the store works now; updates `health`."""

    def can_serve(self) -> bool:
        """Healthy; or unhealthy with the cool-down over and a probe that succeeds now."""
        if self.health.is_healthy:
            return True
        return self.health.can_try() and self.probe()

    @abc.abstractmethod
    def close(self) -> None:
        """Idempotent."""

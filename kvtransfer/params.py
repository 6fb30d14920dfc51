"""The typed hand-off between a decode service (receiver) and a prefill service (sender).

The decode service allocates the prompt's blocks, then asks the connector for a
`TransferParams` (`PdConnectorWorker.prepare_receive`) and passes it to the prefill service,
which attaches it to its engine request (`transfer_params=`). These cross process
boundaries as proto fields, never pickled.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.common.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class TransferParams:
    """What a prefill worker needs to deliver a prompt's KV into a decode worker's cache.

    The receiver holds prompt blocks [0, num_leading_blocks) already (its prefix cache);
    blocks [num_leading_blocks, ceil(prompt_len / block_size)) go to `dst_block_ids`, in
    order. `deadline` is wall-clock (time.time()) because it crosses hosts.
    """

    transfer_id: bytes  # 16 bytes
    dst_block_ids: tuple[int, ...]
    num_leading_blocks: int
    deadline: float  # unix time
    compat_hash: int
    endpoints: tuple[tuple[str, str], ...] = ()  # (backend, endpoint), e.g. ("ucx", "127.0.0.1:50100")
    backends: tuple[str, ...] = ()  # chain order the receiver wants; empty: the sender's

    def __post_init__(self) -> None:
        object.__setattr__(self, "dst_block_ids", tuple(int(b) for b in self.dst_block_ids))
        object.__setattr__(self, "endpoints", tuple((str(b), str(e)) for b, e in self.endpoints))
        object.__setattr__(self, "backends", tuple(self.backends))
        if len(self.transfer_id) != 16:
            raise InvalidRequestError("transfer_id must be 16 bytes")
        if self.num_leading_blocks < 0:
            raise InvalidRequestError("num_leading_blocks must be >= 0")
        if len(set(self.dst_block_ids)) != len(self.dst_block_ids) or min(self.dst_block_ids, default=0) < 0:
            raise InvalidRequestError("dst_block_ids must be distinct non-negative block ids")

    @property
    def endpoint_map(self) -> dict[str, str]:
        return dict(self.endpoints)

    def monotonic_deadline(self) -> float:
        return time.monotonic() + (self.deadline - time.time())


@dataclass(frozen=True, slots=True)
class ReceiveParams:
    """Marks a decode-side engine request whose prompt KV arrives from a prefill service
    (pass with `remote_prefill=True`): the connector then offers no prefix-cache load for it."""

    transfer_id: bytes

"""What the connector's scheduler half tells its worker half each step (in process)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.connector import ConnectorMetadata
from pdserve.kvtransfer.params import TransferParams


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Scatter these verified store payloads (one block each) into `block_ids`."""

    request_id: str
    block_ids: tuple[int, ...]
    payloads: tuple[memoryview, ...]


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store the request's full prompt blocks from `first_block` on as they complete."""

    request_id: str
    block_hashes: tuple[int, ...]
    first_block: int
    block_digests: tuple[bytes, ...] = ()  # stored with each block: what a later hit must match


@dataclass(frozen=True, slots=True)
class SendSpec:
    """When the prompt is computed, send blocks [params.num_leading_blocks, ...) per params."""

    request_id: str
    params: TransferParams
    num_prompt_tokens: int
    block_hashes: tuple[int, ...]
    block_digests: tuple[bytes, ...] = ()  # stored with blocks a store carries: a later hit must match
    layerwise: bool = True  # may stream per layer (ConnectorRequest.stream_layers); False: whole after the forward


@dataclass(slots=True)
class PdConnectorMetadata(ConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)

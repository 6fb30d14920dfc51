"""The connector's scheduler half: what to load from the tiers under the pool (host memory,
the prefix store), and which prompts to save or send. It sees requests, block ids and block
hashes, never tensors; its lookups in the tiers are `TieredLoads`'."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from pdserve.engine.connector import ConnectorMetadata, ConnectorRequest, KVCacheLayout, KVConnectorScheduler
from pdserve.kvtransfer.connector.metadata import PdConnectorMetadata, SaveSpec, SendSpec
from pdserve.kvtransfer.params import ReceiveParams, TransferParams

if TYPE_CHECKING:  # the tiers import the connector's rooms
    from pdserve.kvtransfer.tiers.loads import TieredLoads


class PdConnectorScheduler(KVConnectorScheduler):
    def __init__(self, loads: "TieredLoads", layout: KVCacheLayout) -> None:
        self.loads = loads
        self.layout = layout
        self._announced: dict[tuple[str, str], SaveSpec | SendSpec] = {}  # last spec sent
        self._delivered: set[str] = set()  # requests whose send the worker half knows of
        self._meta = PdConnectorMetadata()

    @property
    def num_matched_blocks(self) -> int:
        """Store blocks offered to the engine, all requests."""
        return self.loads.num_matched_blocks

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> int:
        if isinstance(request.transfer_params, ReceiveParams):
            return 0  # a remote prefill fills this one (the decode service drives it)
        bs = self.layout.block_size
        start = num_computed_tokens // bs
        hits = self.loads.match(request, start)
        if self.loads.saves:
            self._announce(request.request_id, SaveSpec(request.request_id, request.block_hashes, start + hits,
                                                        request.block_digests))
        return hits * bs

    def matched_tokens_by_tier(self, request_id: str) -> dict[str, int]:
        return self.loads.tokens_by_tier(request_id)

    def _announce(self, request_id: str, spec: SaveSpec | SendSpec) -> None:
        key = (type(spec).__name__, request_id)
        if self._announced.get(key) == spec:
            return
        self._announced[key] = spec
        (self._meta.saves if isinstance(spec, SaveSpec) else self._meta.sends).append(spec)

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        """`block_ids`: all of the request's blocks, in order (local prefix hit first). A
        send is announced here, once its blocks exist: the step that allocated them runs it."""
        params = request.transfer_params
        if isinstance(params, TransferParams):
            self._announce(request.request_id, SendSpec(
                request.request_id, params, len(request.prompt_token_ids), request.block_hashes,
                request.block_digests, request.stream_layers))
        load = self.loads.load_spec(request.request_id, block_ids, num_external_tokens)
        if load is not None:
            self._meta.loads.append(load)

    def build_connector_meta(self) -> ConnectorMetadata:
        meta, self._meta = self._meta, PdConnectorMetadata()
        self._delivered.update(spec.request_id for spec in meta.sends)
        meta.request_ids = sorted({s.request_id for s in (*meta.loads, *meta.saves, *meta.sends)})
        return meta

    def request_finished(self, request: ConnectorRequest, block_ids: Sequence[int]) -> bool:
        """Keep the blocks of a request whose send the worker half has: it reports the send
        done through `get_finished` (a send it never heard of never starts)."""
        rid = request.request_id
        self.loads.forget(rid)
        self._announced.pop(("SaveSpec", rid), None)
        self._announced.pop(("SendSpec", rid), None)
        self._meta.sends = [spec for spec in self._meta.sends if spec.request_id != rid]
        self._meta.saves = [spec for spec in self._meta.saves if spec.request_id != rid]
        self._meta.loads = [spec for spec in self._meta.loads if spec.request_id != rid]
        if rid in self._delivered:
            self._delivered.discard(rid)
            return True
        return False

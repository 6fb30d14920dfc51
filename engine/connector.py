"""The engine's extension point for moving KV blocks in and out of the paged cache.

The connector comes in two halves that never share memory:

* the scheduler half runs beside the scheduler. It sees requests and block ids, never
  tensors. Each step it packs what the worker half must do into a `ConnectorMetadata`.
* the worker half runs beside the model. It owns the cache tensors (registered once) and
  moves bytes: loads before the forward, saves layer by layer during it, so a send can
  overlap the rest of the forward.

The engine calls, per step, in this order::

    scheduler: get_num_new_matched_tokens -> (allocate) -> update_state_after_alloc
    scheduler: build_connector_meta                  (once, after scheduling the step)
    worker:    start_load_kv(meta)                   (before the forward)
    worker:    wait_for_layer_load(i); save_kv_layer(i, ...)   (per layer, in the forward)
    worker:    wait_for_save()                        (after the forward)
    worker:    get_finished(finished_ids)             (after every step: each end is told here, once)
    scheduler: request_finished                        (when a request ends, any way)

A step that runs no forward still hands the worker its metadata when there is any: the
store loads of a request that waits for a remote prefill land then.

Loads through the connector are synchronous: what `get_num_new_matched_tokens` offers is
in hand when it returns (fetched and verified) and lands in `start_load_kv`, so a request
never waits on the connector between steps.

A remote prefill (decode side of disaggregation) is *not* a connector path; the engine runs
it and the decode service drives it:

1. `add_request(..., remote_prefill=True)`: at admission the scheduler allocates blocks for
   the whole prompt, lets the connector load what it offers (a persistent prefix store) as
   for any request, and parks the request in `WAITING_FOR_REMOTE_KVS` with
   `num_computed_tokens` = prefix hit + loads (`step()` returns it among those now waiting,
   its loads already scattered). The prefill fills the blocks after those.
2. The service reserves those blocks with its transport and asks a prefill service to fill
   them; the prefill's answer carries the first token, which no local forward produced.
3. It ends the wait with exactly one of `finish_remote_prefill(id, first_token)` (the blocks
   hold the prompt's KV: decode from them), `recompute_remote_prefill(id)` (compute the
   prompt here, in the same blocks) or `abort(id)` (the blocks go back now).

The connector's `get_finished` therefore reports sends only: nothing else frees blocks.

The engine builds its connector once the cache is sized: it is given a `ConnectorFactory`
and calls it with the cache's `KVCacheLayout`, so both halves know the layout from the start
(a ready `Connector` is taken as it is). `Connector()` (the no-op pair) is the "no connector"
object; the engine never checks for None.
Backends live in `pdserve.kvtransfer`; the engine never imports that package.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class BackendState:
    """One transfer backend as its worker sees it now, for load reports and health."""

    name: str
    usable: bool  # healthy, or its cool-down is over (the next call probes it)
    detail: str = ""  # why not usable


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """What a peer must agree on before it may write our blocks.

    Per layer: `[num_blocks, 2, block_size, num_kv_heads, head_dim]` of `dtype`. One block of
    one layer is `2 * block_size * num_kv_heads * head_dim` elements; a block across all
    layers (the unit the transfer layer moves) is `num_layers` times that.
    """

    model_name: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    weights: str = ""  # "" as loaded, or the quantization: KV computed from int8 weights differs
    attention_window: int = 0  # 0: full attention; a window changes every layer's KV after the first
    weights_fingerprint: str = ""  # engine.fingerprint of the weight files ("": none taken, tests)

    @property
    def block_numel_per_layer(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim

    def compatibility_hash(self) -> int:
        """64-bit hash of everything but num_blocks: equal hashes mean interchangeable blocks."""
        from pdserve.common.block_hash import stable_hash64

        # an unquantized, full-attention layout hashes as it always did
        weights = (f"weights={self.weights}",) if self.weights else ()
        window = (f"window={self.attention_window}",) if self.attention_window else ()
        fingerprint = (f"weights-fingerprint={self.weights_fingerprint}",) if self.weights_fingerprint else ()
        return stable_hash64(
            "kv-layout-v1", self.model_name, self.num_layers, self.block_size, self.num_kv_heads,
            self.head_dim, self.dtype, "layout=[blocks,2,bs,kvh,hd]", *weights, *window, *fingerprint)


@dataclass(frozen=True, slots=True)
class ConnectorRequest:
    """What the scheduler half knows of a request: ids and hashes, no tensors."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]  # hash of each *full* prompt block, chained (block_pool)
    transfer_params: object | None = None  # backend-specific typed params (a handoff), opaque here
    block_digests: tuple[bytes, ...] = ()  # each full block's digest (common.block_hash): what a store hit must match
    # a sender may stream the KV layer by layer as the forward computes it (False: the forward
    # takes every core it was lent, none is left to overlap a transfer on: send it whole after)
    stream_layers: bool = True


@dataclass(slots=True)
class ConnectorMetadata:
    """What the worker half must do this step. Backends subclass it with typed fields."""

    # the requests it carries work for; in a step without a forward the engine hands the
    # worker its metadata only when this names some
    request_ids: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LayerSaveContext:
    """Passed with each `save_kv_layer`: which request owns which blocks this step."""

    block_ids_by_request: dict[str, tuple[int, ...]]
    num_computed_by_request: dict[str, int]  # tokens whose KV is final after this step


class KVConnectorScheduler(abc.ABC):
    """Scheduler half. Runs on the scheduler's thread; must not block for long."""

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> int:
        """How many prompt tokens beyond `num_computed_tokens` (the local prefix-cache hit)
        the connector can load, already in hand: they are scattered by `start_load_kv` of
        the step that admits the request, before its forward. A multiple of the block size;
        at least one prompt token must be left to compute. Called before allocation, maybe
        again for the same request if allocation failed; must not reserve anything it would
        leak if the request is never admitted (`request_finished` is called either way)."""

    def matched_tokens_by_tier(self, request_id: str) -> dict[str, int]:
        """Of the tokens `get_num_new_matched_tokens` offered `request_id` last, how many
        each tier below the pool holds ("host", "disk", "redis"). Default: none."""
        return {}

    @abc.abstractmethod
    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        """Blocks are allocated for `request` (after every allocation, `num_external_tokens`
        possibly 0): remember what to load into them, or send from them, this step."""

    @abc.abstractmethod
    def build_connector_meta(self) -> ConnectorMetadata:
        """Everything recorded since the last call, for the worker half. Resets the record."""

    @abc.abstractmethod
    def request_finished(self, request: ConnectorRequest, block_ids: Sequence[int]) -> bool:
        """The request ended (any way). True: keep its blocks until `get_finished` reports
        its save done; False: the engine may free them now."""


class KVConnectorWorker(abc.ABC):
    """Worker half. Runs beside the model forward; owns no scheduling state."""

    @abc.abstractmethod
    def register_kv_caches(self, kv_caches: Sequence["torch.Tensor"], layout: KVCacheLayout) -> None:
        """The engine's cache tensors, one per layer. Called once before the first step."""

    def register_block_pool(self, kv: object) -> None:
        """The engine's `KVCacheManager`, offered once after `register_kv_caches`: a connector
        with tiers under the pool hooks the pool's evictions (`BlockPool.on_evict`) and the
        manager's `offload_fence` here. Default: nothing (evicted blocks are dropped)."""

    @abc.abstractmethod
    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        """Begin loading what `metadata` names into the cache (before the forward)."""

    @abc.abstractmethod
    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until layer `layer_idx`'s loads are in place (with a deadline)."""

    @abc.abstractmethod
    def save_kv_layer(self, layer_idx: int, kv_layer: "torch.Tensor",
                      context: LayerSaveContext) -> None:
        """Layer `layer_idx` is written for this step; start sending/storing what must go."""

    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves are handed off (with a deadline)."""

    @abc.abstractmethod
    def get_finished(self, finished_request_ids: set[str]) -> set[str]:
        """Ids whose sends are done. `finished_request_ids`: those the engine ended this
        step (the worker half learns of a request's end here, and only here). Every id
        `request_finished` kept (True) must come back here eventually, send done or failed;
        the engine frees its blocks then. Called after every step."""

    def backend_states(self) -> Sequence[BackendState]:
        """Each transfer backend's state now (thread-safe, cheap: read at every load report);
        none without a transfer layer."""
        return ()


class NoopConnectorScheduler(KVConnectorScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass

    def build_connector_meta(self):
        return ConnectorMetadata()

    def request_finished(self, request, block_ids):
        return False


class NoopConnectorWorker(KVConnectorWorker):
    def register_kv_caches(self, kv_caches, layout):
        pass

    def start_load_kv(self, metadata):
        pass

    def wait_for_layer_load(self, layer_idx):
        pass

    def save_kv_layer(self, layer_idx, kv_layer, context):
        pass

    def wait_for_save(self):
        pass

    def get_finished(self, finished_request_ids):
        return set()


@dataclass(frozen=True, slots=True)
class Connector:
    """The pair the engine is built with."""

    scheduler: KVConnectorScheduler = field(default_factory=NoopConnectorScheduler)
    worker: KVConnectorWorker = field(default_factory=NoopConnectorWorker)


ConnectorFactory = Callable[[KVCacheLayout], Connector]  # called with the engine's cache layout

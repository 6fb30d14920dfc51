"""The connector's room for the engine's side of the prefill's sends: called on the engine's
thread only. The service's side of the same sends (`SendControl`: verdicts, aborts,
connecting ahead) is `ServiceSends`; the two share the `SendBook`.

A request announced with a hand-off (`SendSpec`) goes out one of two ways:

* layer-wise, when a point-to-point backend leads the chain for it (`stream.LayerStream`):
  each layer's KV of the blocks a step completes leaves while the next layer computes;
* whole, otherwise (or when the hand-off is refused): once its prompt is computed, its
  blocks are gathered (at once: they are ours only during that step) and the fallback chain
  runs in the background.

Either way the send ends in exactly one verdict, posted to the book's `VerdictBoard` where
the prefill service reads it, and the request is reported done to the engine (which holds
its blocks until then) once the engine has said it finished.

Caller: the worker half, on the engine's thread (`attach`, `announce`, `add_layer`,
`end_step`, `finished`, `take_done`, `flush`, `close`). Threads of its own: sends (2),
streams (2); the connects are `Connections`'.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Sequence

import torch

from pdserve.common.util import cdiv
from pdserve.engine.connector import KVCacheLayout, LayerSaveContext
from pdserve.kernels.omp import one_intra_op_thread
from pdserve.kvtransfer.blocks import gather_for_send
from pdserve.kvtransfer.chain import FallbackChain, SendJob
from pdserve.kvtransfer.codec import encode_message, ephemeral_key
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.connector.background import Background
from pdserve.kvtransfer.connector.connections import Connections
from pdserve.kvtransfer.connector.metadata import SendSpec
from pdserve.kvtransfer.connector.send_book import SendBook
from pdserve.kvtransfer.params import TransferParams
from pdserve.kvtransfer.backend_loader import OpenedBackends
from pdserve.kvtransfer.sink import limits_for
from pdserve.kvtransfer.stream import LayerStream
from pdserve.kvtransfer.verdict import Fallback, Landing, TransferVerdict


class EngineSends:
    def __init__(self, config: KVTransferConfig, backends: OpenedBackends, chain: FallbackChain,
                 layout: KVCacheLayout, book: SendBook, connections: Connections, *, warm_up: bool) -> None:
        """`warm_up`: start the transports as soon as the cache is attached (a prefill)."""
        self.config = config
        self._warm_up = warm_up
        self.backends = backends
        self.chain = chain
        self.layout = layout
        self.limits = limits_for(layout)
        self.book = book
        self.connections = connections
        self._kv_caches: list[torch.Tensor] = []
        self._sends_bg = Background(ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdkv-send",
                                                       initializer=one_intra_op_thread))
        self._streams_bg = Background(ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdkv-stream",
                                                         initializer=one_intra_op_thread))
        self._step_streams: list[LayerStream] = []  # the streams this step's forward feeds
        self._closed = False

    def attach(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """The engine's cache; a prefill's transports start now, not on its first send."""
        self._kv_caches = list(kv_caches)
        if self._warm_up:
            self.connections.start_transports()

    # -- the engine's thread ---------------------------------------------------------------
    def announce(self, spec: SendSpec) -> None:
        if self.book.announce(spec):
            self._open_stream(spec)

    def add_layer(self, layer_idx: int, kv_layer: torch.Tensor, context: LayerSaveContext) -> None:
        """Streams take this layer's slice now; whole sends wait for the step's end."""
        if layer_idx == 0:
            self._step_streams = self.book.streams_of(context.num_computed_by_request)
            for stream in self._step_streams:
                stream.plan_step(context)
        for stream in self._step_streams:
            stream.add_layer(layer_idx, kv_layer)

    def end_step(self, context: LayerSaveContext, forward_end: float) -> None:
        """Start the sends whose prompts this step completed."""
        ready = self.book.take_ready(context.num_computed_by_request)
        self._step_streams = []
        for spec, stream in ready:
            if stream is not None:
                stream.finish(forward_end)  # the verdict follows the stream's tail
            else:
                self._start_send(spec, context.block_ids_by_request[spec.request_id], forward_end)

    def finished(self, request_id: str) -> None:
        """The engine ended the request (told once). A send that never started ends now,
        aborted; one under way is reported done when it ends."""
        spec = self.book.end(request_id)
        if spec is not None:
            self.book.finish(request_id, TransferVerdict(spec.params.transfer_id.hex(), Landing.ABORTED, ""))

    def take_done(self) -> set[str]:
        """Requests the engine ended whose sends are done: their blocks may go."""
        return self.book.take_done()

    # -- sending ---------------------------------------------------------------------------
    def _open_stream(self, spec: SendSpec) -> None:
        """Send `spec` layer-wise when a point-to-point backend leads the chain for it now
        (else, or if the hand-off is refused, it goes whole after the forward); not when the
        config or the request (`SendSpec.layerwise`) says whole."""
        rid, params = spec.request_id, spec.params
        if not (self.config.layerwise and spec.layerwise) or self._closed:
            return
        keys = self._send_keys(spec)
        if self._refuse_reason(params, len(keys)):
            return
        backend = self.chain.stream_backend(dict(params.endpoints), params.backends)
        if backend is None:
            return
        self.book.add_stream(rid, lambda: LayerStream(
            rid, params, keys, spec.num_prompt_tokens, backend, self.chain,
            self.limits, self._kv_caches, submit=self._streams_bg.submit, on_verdict=self.book.finish,
            digests=spec.block_digests[params.num_leading_blocks:],
            on_device=self._device_direct(backend)))

    def _send_keys(self, spec: SendSpec) -> tuple[int, ...]:
        """The store key of each block sent: its content hash, or a short-lived key."""
        params = spec.params
        num_prompt_blocks = cdiv(spec.num_prompt_tokens, self.layout.block_size)
        return tuple(spec.block_hashes[i] if i < len(spec.block_hashes)
                     else ephemeral_key(params.transfer_id, i)
                     for i in range(params.num_leading_blocks, num_prompt_blocks))

    def _start_send(self, spec: SendSpec, block_ids: Sequence[int], forward_end: float) -> None:
        """Gather now (the blocks are only ours during this step), send in the background.
        Whatever goes wrong ends in a verdict, so the request is always reported back."""
        rid, params = spec.request_id, spec.params
        num_prompt_blocks = cdiv(spec.num_prompt_tokens, self.layout.block_size)
        src = list(block_ids[params.num_leading_blocks:num_prompt_blocks])
        problem = self._refuse_reason(params, len(src))
        try:
            if not problem:
                blocks, ready = gather_for_send(self._kv_caches, src, self._device_direct())
                self._sends_bg.submit(self._run_send, rid, params, self._send_keys(spec), blocks, forward_end,
                                      spec.block_digests[params.num_leading_blocks:], ready)
                return
        except RuntimeError as exc:  # the pool is shut down: the engine must still get the request back
            problem = f"{exc.__class__.__name__}: {exc}"
        self.book.finish(rid, TransferVerdict(params.transfer_id.hex(), Landing.MISSING, "",
                                              fallbacks=(Fallback("sender", problem),)))

    def _device_direct(self, backend: str | None = None) -> bool:
        """Whether sends keep their blocks on the GPU: the cache is there and `backend` (any
        opened transport when None) moves GPU tensors as they are. A host backend later in
        the chain copies them to the host itself."""
        if not (self._kv_caches and self._kv_caches[0].is_cuda):
            return False
        transports = self.backends.transports
        if backend is not None:
            return getattr(transports.get(backend), "device_direct", False)
        return any(t.device_direct for t in transports.values())

    def _refuse_reason(self, params: TransferParams, num_src: int) -> str:
        if params.compat_hash != self.limits.compat_hash:
            return (f"compatibility hash mismatch: receiver {params.compat_hash:#x}, "
                    f"sender {self.limits.compat_hash:#x}")
        if num_src != len(params.dst_block_ids):
            return f"the receiver reserved {len(params.dst_block_ids)} blocks for {num_src} prompt blocks"
        return ""

    def _run_send(self, rid: str, params: TransferParams, keys: tuple[int, ...],
                  blocks: torch.Tensor, forward_end: float, digests: tuple[bytes, ...] = (),
                  ready: object | None = None) -> None:
        """`digests`: those of the leading full blocks sent (a store keeps them with the blocks);
        `ready`: the CUDA event behind the gather of GPU `blocks`."""
        try:
            if ready is not None:
                ready.synchronize()
            message = encode_message(self.limits, params.transfer_id, params.dst_block_ids, keys, blocks)
            verdict = self.chain.send(SendJob(params.transfer_id, message, keys, params.endpoint_map,
                                              params.backends, params.monotonic_deadline(), digests))
        except Exception as exc:  # noqa: BLE001 - the chain catches backend errors; a last guard, so a verdict always comes
            verdict = TransferVerdict(params.transfer_id.hex(), Landing.MISSING, "",
                                      fallbacks=(Fallback("sender", repr(exc)),))
        self.book.finish(rid, replace(verdict, tail_s=time.monotonic() - forward_end))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for the sends under way. False if some are still running at the deadline."""
        return self._streams_bg.flush(timeout_s) and self._sends_bg.flush(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the sends under way (up to `timeout_s`); take no more. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._sends_bg.close(timeout_s)
        self._streams_bg.close(timeout_s)
        self.connections.close()

"""The connector's room for the prefill's sends (`SendControl`).

A request announced with a hand-off (`SendSpec`) goes out one of two ways:

* layer-wise, when a point-to-point backend leads the chain for it (`stream.LayerStream`):
  each layer's KV of the blocks a step completes leaves while the next layer computes;
* whole, otherwise (or when the hand-off is refused): once its prompt is computed, its
  blocks are gathered (at once: they are ours only during that step) and the fallback chain
  runs in the background.

Either way the send ends in exactly one verdict, posted to the `VerdictBoard` where the
prefill service reads it, and the request is reported done to the engine (which holds its
blocks until then) once the engine has said it finished.

Callers: the worker half on the engine's thread (`announce`, `add_layer`, `end_step`,
`finished`, `take_done`); the prefill service on any thread (`wait_verdict`, `abort_send`,
`unusable`, `connect_ahead`). Threads of its own: sends (2), streams (2), connects (1).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
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
from pdserve.kvtransfer.connector.metadata import SendSpec
from pdserve.kvtransfer.params import TransferParams
from pdserve.kvtransfer.backend_loader import OpenedBackends
from pdserve.kvtransfer.sink import limits_for
from pdserve.kvtransfer.stream import LayerStream
from pdserve.kvtransfer.verdict import Fallback, Outcome, TransferVerdict

log = logging.getLogger("pdserve.kvtransfer.connector")

_MAX_REMEMBERED = 4096  # finished sends / verdicts kept for late readers


class VerdictBoard:
    """Verdicts of finished sends by request id, for the service to read (bounded)."""

    def __init__(self, capacity: int = _MAX_REMEMBERED) -> None:
        self._cond = threading.Condition()
        self._verdicts: OrderedDict[str, TransferVerdict] = OrderedDict()
        self._capacity = capacity

    def post(self, request_id: str, verdict: TransferVerdict) -> None:
        with self._cond:
            self._verdicts[request_id] = verdict
            while len(self._verdicts) > self._capacity:
                self._verdicts.popitem(last=False)
            self._cond.notify_all()

    def wait(self, request_id: str, timeout_s: float) -> TransferVerdict | None:
        """The verdict (removed from the board), or None if none came within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while request_id not in self._verdicts:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._verdicts.pop(request_id)


class PrefillSends:
    def __init__(self, config: KVTransferConfig, backends: OpenedBackends, chain: FallbackChain,
                 layout: KVCacheLayout, *, warm_up: bool) -> None:
        """`warm_up`: start the transports as soon as the cache is attached (a prefill)."""
        self.config = config
        self._warm_up = warm_up
        self.backends = backends
        self.chain = chain
        self.layout = layout
        self.limits = limits_for(layout)
        self.verdicts = VerdictBoard()
        self._kv_caches: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._sends_bg = Background(ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdkv-send",
                                                       initializer=one_intra_op_thread))
        self._streams_bg = Background(ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdkv-stream",
                                                         initializer=one_intra_op_thread))
        self._connect_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdkv-connect")
        self._streams: dict[str, LayerStream] = {}  # announced sends going out layer-wise
        self._step_streams: list[LayerStream] = []  # those this step's forward feeds
        self._connected: set[tuple[str, str]] = set()  # (backend, endpoint) warmed or warming
        self._sends: dict[str, SendSpec] = {}  # announced, not started
        self._sending: set[str] = set()  # started, not finished
        self._ended: set[str] = set()  # the engine said these finished
        self._sent: OrderedDict[str, None] = OrderedDict()  # done, not yet reported
        self._closed = False

    def attach(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """The engine's cache; a prefill's transports start now, not on its first send."""
        self._kv_caches = list(kv_caches)
        for name, transport in self.backends.transports.items() if self._warm_up else ():
            self._connect_pool.submit(_prepare, name, transport)

    # -- the engine's thread ---------------------------------------------------------------
    def announce(self, spec: SendSpec) -> None:
        with self._lock:
            if spec.request_id in self._sending or spec.request_id in self._sent:
                return
            self._sends[spec.request_id] = spec
        self._open_stream(spec)

    def add_layer(self, layer_idx: int, kv_layer: torch.Tensor, context: LayerSaveContext) -> None:
        """Streams take this layer's slice now; whole sends wait for the step's end."""
        if layer_idx == 0:
            with self._lock:
                self._step_streams = [stream for rid, stream in self._streams.items()
                                      if rid in context.num_computed_by_request]
            for stream in self._step_streams:
                stream.plan_step(context)
        for stream in self._step_streams:
            stream.add_layer(layer_idx, kv_layer)

    def end_step(self, context: LayerSaveContext, forward_end: float) -> None:
        """Start the sends whose prompts this step completed."""
        done = context.num_computed_by_request
        with self._lock:  # a prompt computed this step is popped here, under the lock, so a
            ready = [self._sends.pop(rid) for rid, spec in list(self._sends.items())  # racing
                     if done.get(rid, 0) >= spec.num_prompt_tokens]  # abort_send sees it gone
            self._sending.update(spec.request_id for spec in ready)
            streams = {spec.request_id: self._streams.pop(spec.request_id, None) for spec in ready}
        self._step_streams = []
        for spec in ready:
            stream = streams[spec.request_id]
            if stream is not None:
                stream.finish(forward_end)  # the verdict follows the stream's tail
            else:
                self._start_send(spec, context.block_ids_by_request[spec.request_id], forward_end)

    def finished(self, request_id: str) -> None:
        """The engine ended the request (told once). A send that never started ends now,
        aborted; one under way is reported done when it ends."""
        with self._lock:
            spec = self._sends.pop(request_id, None)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.cancel()
            if spec is not None or request_id in self._sending or request_id in self._sent:
                self._ended.add(request_id)  # a send of ours: report it once it is done
        if spec is not None:
            self._finish_send(request_id, TransferVerdict(spec.params.transfer_id.hex(), Outcome.ABORTED, ""))

    def take_done(self) -> set[str]:
        """Requests the engine ended whose sends are done: their blocks may go."""
        with self._lock:
            done = {rid for rid in self._sent if rid in self._ended}
            for rid in done:
                del self._sent[rid]
                self._ended.discard(rid)
        return done

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
        with self._lock:
            if rid in self._streams or rid not in self._sends:
                return
            self._streams[rid] = LayerStream(
                rid, params, keys, spec.num_prompt_tokens, backend, self.chain,
                self.limits, self._kv_caches, submit=self._streams_bg.submit, on_verdict=self._finish_send,
                digests=spec.block_digests[params.num_leading_blocks:],
                on_device=self._device_direct(backend))

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
        self._finish_send(rid, TransferVerdict(params.transfer_id.hex(), Outcome.FAILED, "",
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
            verdict = TransferVerdict(params.transfer_id.hex(), Outcome.FAILED, "",
                                      fallbacks=(Fallback("sender", repr(exc)),))
        self._finish_send(rid, replace(verdict, tail_s=time.monotonic() - forward_end))

    def _finish_send(self, rid: str, verdict: TransferVerdict) -> None:
        with self._lock:
            self._mark_sent(rid)
        self._post(rid, verdict)

    def _mark_sent(self, rid: str) -> None:
        """The send of `rid` is done (caller holds the lock). In the same hold as the pop
        that ended it: `finished` must find the request in `_sends`, `_sending` or `_sent`,
        or its blocks would never be reported back."""
        self._sending.discard(rid)
        self._sent[rid] = None
        while len(self._sent) > _MAX_REMEMBERED:
            self._sent.popitem(last=False)

    def _post(self, rid: str, verdict: TransferVerdict) -> None:
        (log.info if verdict.ok else log.warning)("request %s: %s", rid, verdict.describe())
        self.verdicts.post(rid, verdict)

    # -- the prefill service (any thread) --------------------------------------------------
    def wait_verdict(self, request_id: str, timeout_s: float) -> TransferVerdict | None:
        """`SendControl.wait_verdict`: the verdict of a send, taken from the board."""
        return self.verdicts.wait(request_id, timeout_s)

    def unusable(self, params: TransferParams) -> list[Fallback]:
        return self.chain.unusable(dict(params.endpoints), params.backends)

    def connect_ahead(self, params: TransferParams) -> None:
        """`SendControl.connect_ahead`: warm the links to a receiver's transports in the
        background (once per endpoint), overlapping the connection with the prefill."""
        for backend, endpoint in params.endpoints:
            transport = self.backends.transports.get(backend)
            with self._lock:
                if transport is None or self._closed or (backend, endpoint) in self._connected:
                    continue
                self._connected.add((backend, endpoint))
            self._connect_pool.submit(self._connect, backend, transport, endpoint)

    def _connect(self, backend: str, transport, endpoint: str) -> None:
        start = time.monotonic()
        try:
            transport.connect_ahead(endpoint, start + self.config.step_timeout_s)
        except Exception as exc:  # noqa: BLE001 - the send will connect (and report) on its own
            with self._lock:
                self._connected.discard((backend, endpoint))
            log.info("kv %s: connecting ahead to %s failed: %s", backend, endpoint, exc)
            return
        log.info("kv %s: connected to %s ahead of its first send (%.1f ms)", backend, endpoint,
                 (time.monotonic() - start) * 1000)

    def abort_send(self, request_id: str) -> bool:
        """The request is being aborted. A send that has not started never will (its verdict
        says aborted); one under way runs to its own deadline. True if a pending send was
        dropped."""
        with self._lock:
            spec = self._sends.pop(request_id, None)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.cancel()  # no more layers go out; the receiver's reservation ends
            if spec is not None:
                self._mark_sent(request_id)
        if spec is None:
            return False
        self._post(request_id, TransferVerdict(spec.params.transfer_id.hex(), Outcome.ABORTED, ""))
        return True

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
        self._connect_pool.shutdown(wait=True, cancel_futures=True)


def _prepare(name: str, transport) -> None:
    try:
        transport.prepare()
    except Exception as exc:  # noqa: BLE001 - the first send will try again (and report)
        log.warning("kv transport %s could not start ahead: %s", name, exc)

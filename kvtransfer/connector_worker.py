"""The connector's worker half: moves bytes between the cache and the transfer layer.

* loads: scatters prefetched store payloads before the forward;
* saves: after the forward, gathers newly completed full prompt blocks and stores them in
  the background;
* sends (prefill side): to a point-to-point receiver, layer by layer as the prompt computes
  (`stream.LayerStream`: each layer's KV of the blocks a step completes, sent while the next
  layer computes); otherwise, when a request's prompt is complete, gathers its blocks and
  runs the fallback chain in the background. The verdict goes to `verdicts`;
* receives (decode side): `prepare_receive` / `complete_receive` / `cancel_receive`, called
  by the decode service from any thread; transports deliver into `sink`.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from pdserve.engine.connector import (
    BackendState, ConnectorMetadata, KVCacheLayout, KVConnectorWorker, LayerSaveContext,
)
from pdserve.common.errors import InvalidRequestError, TransferError
from pdserve.common.util import cdiv
from pdserve.kvtransfer.base import BlockStore
from pdserve.kvtransfer.blocks import buffer_from_bytes, gather_to_host, scatter_from_host
from pdserve.kvtransfer.chain import FallbackChain, SendJob
from pdserve.kvtransfer.codec import encode_message, ephemeral_key, new_transfer_id
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.connector_meta import LayoutBox, PdConnectorMetadata, SendSpec
from pdserve.kvtransfer.params import TransferParams
from pdserve.kvtransfer.receive import land_from_store
from pdserve.kvtransfer.registry import OpenedBackends
from pdserve.kvtransfer.sink import CacheSink, limits_for
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


@dataclass(slots=True)
class _SaveState:
    block_hashes: tuple[int, ...]
    next_block: int


@dataclass(slots=True)
class _Receive:
    transfer_id: bytes
    dst_block_ids: tuple[int, ...]


class PdConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, backends: OpenedBackends,
                 prefix_store: BlockStore | None, layout_box: LayoutBox, *,
                 listen: bool = True) -> None:
        self.config = config
        self.backends = backends
        self.prefix_store = prefix_store
        self._layout_box = layout_box
        self._listen = listen
        self.verdicts = VerdictBoard()
        self.chain = FallbackChain(config.backends, transports=backends.transports,
                                   stores=backends.stores, unavailable=backends.unavailable,
                                   step_timeout_s=config.step_timeout_s,
                                   health_policy=config.health_policy)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdkv")
        self._connect_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdkv-connect")
        self._stream_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdkv-stream")
        self._streams: dict[str, LayerStream] = {}  # announced sends going out layer-wise
        self._step_streams: list[LayerStream] = []  # those this step's forward feeds
        self._connected: set[tuple[str, str]] = set()  # (backend, endpoint) warmed or warming
        self._inflight: set[Future] = set()
        self._saves: dict[str, _SaveState] = {}
        self._sends: dict[str, SendSpec] = {}  # announced, not started
        self._sending: set[str] = set()  # started, not finished
        self._ended_while_sending: set[str] = set()  # the engine finished them mid-send
        self._sent: OrderedDict[str, bool] = OrderedDict()  # done; value: engine said finished
        self._receives: dict[str, _Receive] = {}
        self._endpoints: dict[str, str] = {}
        self._context: LayerSaveContext | None = None
        self.sink: CacheSink | None = None
        self.kv_caches: list[torch.Tensor] = []
        self._closed = False

    # -- engine-facing ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches, layout: KVCacheLayout) -> None:
        self.kv_caches = list(kv_caches)
        self.layout = layout
        self.limits = limits_for(layout)
        self._layout_box.layout = layout
        self.sink = CacheSink(self.kv_caches, layout)
        if not self._listen:  # a sender: start the transports now, not on the first send
            for name, transport in self.backends.transports.items():
                self._connect_pool.submit(self._prepare, name, transport)
            return
        for name, transport in self.backends.transports.items():
            try:
                self._endpoints[name] = transport.open_receiver(self.sink)
            except Exception as exc:  # a transport that cannot listen is skipped, with a reason
                self.backends.unavailable[name] = self.chain.unavailable[name] = f"cannot listen: {exc}"
                log.warning("kv transport %s cannot listen: %s", name, exc)

    @property
    def endpoints(self) -> dict[str, str]:
        return dict(self._endpoints)

    def backend_states(self) -> list[BackendState]:
        return self.chain.states()

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        if not isinstance(metadata, PdConnectorMetadata):
            return
        for rid, kept in metadata.finished:
            self._on_finished(rid, kept, from_scheduler=True)
        for load in metadata.loads:
            payload = b"".join(load.payloads)
            buffer = buffer_from_bytes(memoryview(payload), len(load.block_ids), self.kv_caches)
            scatter_from_host(buffer, self.kv_caches, load.block_ids)
        for save in metadata.saves:
            self._saves[save.request_id] = _SaveState(save.block_hashes, save.first_block)
        for send in metadata.sends:
            with self._lock:
                if send.request_id not in self._sending and send.request_id not in self._sent:
                    self._sends[send.request_id] = send
            self._open_stream(send)

    def wait_for_layer_load(self, layer_idx: int) -> None:
        pass  # loads are scattered whole in start_load_kv, before the forward

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor,
                      context: LayerSaveContext) -> None:
        """Streams take this layer's slice now; saves and whole sends wait for the step's
        end (wait_for_save)."""
        self._context = context
        if layer_idx == 0:
            with self._lock:
                self._step_streams = [stream for rid, stream in self._streams.items()
                                      if rid in context.num_computed_by_request]
            for stream in self._step_streams:
                stream.plan_step(context)
        for stream in self._step_streams:
            stream.add_layer(layer_idx, kv_layer)

    def wait_for_save(self) -> None:
        """Gather what completed this step (synchronously: the blocks may be reused after)
        and hand the writes/sends to the background."""
        context, self._context = self._context, None
        if context is None:
            return
        forward_end = time.monotonic()  # every layer of this step is written
        for rid, state in self._saves.items():
            self._save_completed(rid, state, context)
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

    def get_finished(self, finished_request_ids: set[str]) -> set[str]:
        """Sends done — reported on every call until the engine has seen the request finish.
        A request `request_finished` kept always comes back. Also expires overdue receives
        (their reservations end; the decode service settles them by verdict, not here)."""
        for rid in finished_request_ids:
            self._on_finished(rid, kept=False, from_scheduler=False)
        if self.sink is not None:
            self.sink.expire_overdue()
            self.sink.take_events()  # receives are settled by complete_receive
        with self._lock:
            done = set(self._sent)
            for rid in [r for r, seen in self._sent.items() if seen]:
                del self._sent[rid]  # reported after the finish: the engine has it
        return done

    # -- persistent prefix cache --------------------------------------------------------
    def _save_completed(self, rid: str, state: _SaveState, context: LayerSaveContext) -> None:
        block_ids = context.block_ids_by_request.get(rid)
        if block_ids is None or self.prefix_store is None or self._closed:
            return
        num_full = min(context.num_computed_by_request.get(rid, 0) // self.layout.block_size,
                       len(state.block_hashes), len(block_ids))
        if num_full <= state.next_block:
            return
        first, state.next_block = state.next_block, num_full
        blocks = gather_to_host(self.kv_caches, block_ids[first:num_full])
        keys = state.block_hashes[first:num_full]
        self._submit(self._store_blocks, keys, blocks)

    def _store_blocks(self, keys: tuple[int, ...], blocks: torch.Tensor) -> None:
        message = encode_message(self.limits, new_transfer_id(), [0] * len(keys), keys, blocks)
        stored = self.prefix_store.put(keys, message)
        log.debug("prefix cache (%s): stored %d of %d blocks", self.prefix_store.name, stored, len(keys))

    # -- prefill side -------------------------------------------------------------------
    def _open_stream(self, spec: SendSpec) -> None:
        """Send `spec` layer-wise when a point-to-point backend leads the chain for it now
        (else, or if the hand-off is refused, it goes whole after the forward)."""
        rid, params = spec.request_id, spec.params
        if not self.config.layerwise or self._closed:
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
                self.limits, self.kv_caches, submit=lambda fn: self._submit(fn, pool=self._stream_pool),
                on_verdict=self._finish_send)

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
                blocks = gather_to_host(self.kv_caches, src)
                self._submit(self._run_send, rid, params, self._send_keys(spec), blocks, forward_end)
                return
        except Exception as exc:  # e.g. closed: the engine must still get the request back
            problem = f"{exc.__class__.__name__}: {exc}"
        self._finish_send(rid, TransferVerdict(params.transfer_id.hex(), Outcome.FAILED, "",
                                               fallbacks=(Fallback("sender", problem),)))

    def _refuse_reason(self, params: TransferParams, num_src: int) -> str:
        if params.compat_hash != self.limits.compat_hash:
            return (f"compatibility hash mismatch: receiver {params.compat_hash:#x}, "
                    f"sender {self.limits.compat_hash:#x}")
        if num_src != len(params.dst_block_ids):
            return f"the receiver reserved {len(params.dst_block_ids)} blocks for {num_src} prompt blocks"
        return ""

    def _run_send(self, rid: str, params: TransferParams, keys: tuple[int, ...],
                  blocks: torch.Tensor, forward_end: float) -> None:
        try:
            message = encode_message(self.limits, params.transfer_id, params.dst_block_ids,
                                     keys, blocks)
            verdict = self.chain.send(SendJob(params.transfer_id, message, keys,
                                              params.endpoint_map, params.backends,
                                              params.monotonic_deadline()))
        except Exception as exc:  # the chain catches backend errors; this is a last guard
            verdict = TransferVerdict(params.transfer_id.hex(), Outcome.FAILED, "",
                                      fallbacks=(Fallback("sender", repr(exc)),))
        self._finish_send(rid, replace(verdict, tail_s=time.monotonic() - forward_end))

    def _finish_send(self, rid: str, verdict: TransferVerdict) -> None:
        (log.info if verdict.ok else log.warning)("request %s: %s", rid, verdict.describe())
        self.verdicts.post(rid, verdict)
        with self._lock:
            self._sending.discard(rid)
            self._sent[rid] = rid in self._ended_while_sending
            self._ended_while_sending.discard(rid)
            while len(self._sent) > _MAX_REMEMBERED:
                self._sent.popitem(last=False)

    def _on_finished(self, rid: str, kept: bool, from_scheduler: bool) -> None:
        """The engine ended `rid`: drop its save state. A send that never started ends now
        (aborted), so a request whose blocks were `kept` is always reported back.

        Each finish is told twice, in either order: by the scheduler's `request_finished`
        (through the step metadata, with `kept`) and by `get_finished`'s finished ids. Only
        the scheduler's notice retires a finished send's report; retiring it on the other
        would let the scheduler's later notice look like a request never sent and post a
        second, false 'aborted' verdict over the real one."""
        self._saves.pop(rid, None)
        with self._lock:
            spec = self._sends.pop(rid, None)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.cancel()
            if rid in self._sent:
                if from_scheduler:
                    self._sent[rid] = True  # reported once more, then dropped
                return
            if rid in self._sending:
                self._ended_while_sending.add(rid)
                return  # reported when the send ends
        if spec is None and not kept:
            return
        tid = spec.params.transfer_id.hex() if spec is not None else ""
        self._finish_send(rid, TransferVerdict(tid, Outcome.ABORTED, ""))
        with self._lock:
            self._sent[rid] = True

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

    @staticmethod
    def _prepare(name: str, transport) -> None:
        try:
            transport.prepare()
        except Exception as exc:  # the first send will try again (and report)
            log.warning("kv transport %s could not start ahead: %s", name, exc)

    def _connect(self, backend: str, transport, endpoint: str) -> None:
        start = time.monotonic()
        try:
            transport.connect_ahead(endpoint, start + self.config.step_timeout_s)
        except Exception as exc:  # the send will connect (and report) on its own
            with self._lock:
                self._connected.discard((backend, endpoint))
            log.info("kv %s: connecting ahead to %s failed: %s", backend, endpoint, exc)
            return
        log.info("kv %s: connected to %s ahead of its first send (%.1f ms)", backend, endpoint,
                 (time.monotonic() - start) * 1000)

    def unusable(self, params: TransferParams) -> list[Fallback]:
        return self.chain.unusable(dict(params.endpoints), params.backends)

    def wait_verdict(self, request_id: str, timeout_s: float) -> TransferVerdict | None:
        """`SendControl.wait_verdict`: the verdict of a send, taken from the board."""
        return self.verdicts.wait(request_id, timeout_s)

    def abort_send(self, request_id: str) -> bool:
        """Prefill service: the request is being aborted. A send that has not started never
        will (its verdict says aborted); one under way runs to its own deadline. True if a
        pending send was dropped."""
        with self._lock:
            spec = self._sends.pop(request_id, None)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.cancel()  # no more layers go out; the receiver's reservation ends
        if spec is None:
            return False
        self._finish_send(request_id, TransferVerdict(spec.params.transfer_id.hex(),
                                                      Outcome.ABORTED, ""))
        return True

    # -- decode side (called by the decode service, any thread) --------------------------
    @property
    def block_size(self) -> int:
        return self.layout.block_size

    def prepare_receive(self, request_id: str, block_ids: Sequence[int], num_prompt_tokens: int,
                        num_leading_blocks: int, deadline: float,
                        transfer_id: bytes | None = None) -> TransferParams:
        """Reserve the request's prompt blocks after the first `num_leading_blocks` (its local
        prefix hit) for a transfer until `deadline` (time.time()); returns the hand-off to
        give the prefill service. `block_ids`: the request's blocks in order."""
        if self.sink is None:
            raise TransferError("the connector has no cache registered")
        dst = tuple(block_ids[num_leading_blocks:cdiv(num_prompt_tokens, self.layout.block_size)])
        transfer_id = transfer_id or new_transfer_id()
        with self._lock:
            if request_id in self._receives:
                raise InvalidRequestError(f"request {request_id} already has a receive")
            self.sink.expect(transfer_id, dst, time.monotonic() + (deadline - time.time()),
                             tag=request_id)
            self._receives[request_id] = _Receive(transfer_id, dst)
        return TransferParams(transfer_id, dst, num_leading_blocks, deadline,
                              self.limits.compat_hash, tuple(self._endpoints.items()),
                              self.config.backends)

    def complete_receive(self, request_id: str, verdict: TransferVerdict) -> TransferVerdict:
        """Settle a receive with the sender's verdict; returns this side's verdict. `ok`:
        the blocks are in place (decode from them); otherwise recompute (or fail) — the
        reservation is dropped first, so no late write can land in the blocks."""
        with self._lock:
            receive = self._receives.pop(request_id, None)
        if receive is None:
            raise InvalidRequestError(f"request {request_id} has no receive in progress")
        final = self._settle(receive, verdict)
        if not final.ok:
            self.sink.abort(receive.transfer_id)
        (log.info if final.ok else log.warning)("request %s: %s", request_id, final.describe())
        return final

    def _settle(self, receive: _Receive, verdict: TransferVerdict) -> TransferVerdict:
        if not verdict.ok:
            return verdict
        if verdict.transfer_id != receive.transfer_id.hex():
            return verdict.with_fallback(verdict.backend, "verdict is for another transfer",
                                         Outcome.RECOMPUTED)
        if self.sink.is_complete(receive.transfer_id):
            return verdict
        if not verdict.via_store:
            return verdict.with_fallback(verdict.backend, "the receiver did not get every block",
                                         Outcome.RECOMPUTED)
        store = self.backends.stores.get(verdict.backend)
        if store is None:
            return verdict.with_fallback(verdict.backend, "not configured on the receiver",
                                         Outcome.RECOMPUTED)
        start = time.monotonic()
        try:
            land_from_store(store, self.sink, receive.transfer_id, receive.dst_block_ids,
                            verdict.fetch_keys)
        except TransferError as exc:
            return verdict.with_fallback(verdict.backend, f"fetch failed: {exc}",
                                         Outcome.RECOMPUTED, time.monotonic() - start)
        return verdict

    def cancel_receive(self, request_id: str) -> bool:
        """Drop a receive (abort, prefill failed); call before the engine frees the blocks."""
        with self._lock:
            receive = self._receives.pop(request_id, None)
        return receive is not None and self.sink.abort(receive.transfer_id)

    # -- lifecycle ----------------------------------------------------------------------
    def _submit(self, fn, *args, pool: ThreadPoolExecutor | None = None) -> None:
        future = (pool or self._pool).submit(fn, *args)
        with self._lock:
            self._inflight.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: Future) -> None:
        with self._lock:
            self._inflight.discard(future)
        exc = future.exception()
        if exc is not None:
            log.error("kv connector background task failed: %r", exc)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for background stores/sends. False if some are still running at the deadline."""
        with self._lock:
            pending = set(self._inflight)
        _, not_done = wait(pending, timeout=timeout_s)
        return not not_done

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish background work (up to `timeout_s`), stop listening, close backends. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._stream_pool.shutdown(wait=False, cancel_futures=True)
        self._connect_pool.shutdown(wait=True, cancel_futures=True)
        if self.sink is not None:
            self.sink.close()
        self.chain.close()

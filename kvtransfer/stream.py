"""Layer-wise sending: a prompt's KV leaves the prefill while the prompt is still computing.

A `LayerStream` belongs to one request whose blocks go to a point-to-point receiver (ucx,
nccl). A long prompt is prefilled in several steps (chunks); each step completes some of
its blocks:

* a step before the last sends the blocks it completed as one message, every layer, when
  its last layer is written: it goes out while the next step computes;
* the last step sends its blocks layer by layer: as each layer is written, its KV of those
  blocks is queued as a message, sent while the next layer computes. A sender that falls
  behind coalesces the consecutive layers queued into one message (each message has a
  fixed cost, large on busy cores).

So the prompt's KV leaves while the prompt computes, with a message count that stays near
(steps + layers), and when the last step ends `finish` waits only for what is still queued
— the tail, about one layer's message — before the verdict.

The receiver lands each message as it comes (`sink.CacheSink`: layers of blocks) and
accepts the blocks only when every layer of every one has arrived and verified: the verdict
stays all-or-nothing. If a message fails (refused, peer gone, deadline), the stream stops
sending (it still collects the parts) and, once the prompt is computed, the whole prompt
goes through the rest of the fallback chain, built from the parts the stream kept (until
its verdict a stream holds one copy of the prompt's KV, as a whole-prompt send holds its
gathered blocks).

Threads: `plan_step`, `add_layer`, `finish` and `cancel` run on the engine's thread; the
sending runs on the executor given; state shared between them is under the stream's lock.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from pdserve.engine.connector import LayerSaveContext
from pdserve.kvtransfer.blocks import gather_for_send
from pdserve.kvtransfer.chain import FallbackChain, SendJob
from pdserve.kvtransfer.codec import encode_message
from pdserve.kvtransfer.params import TransferParams
from pdserve.kvtransfer.verdict import Fallback, Landing, TransferVerdict
from pdserve.kvtransfer.wire import WireLimits

log = logging.getLogger("pdserve.kvtransfer.stream")


@dataclass(slots=True)
class _Part:
    """Layers `layers` of the send's blocks [first, first + n) (n = data.shape[0])."""

    first: int
    layers: range
    data: torch.Tensor  # [n, len(layers), 2, BS, H, D]: host memory, or GPU for a device-direct backend
    ready: object | None = None  # a CUDA event: `data` is written (its copy or gather is done)
    final: bool = False  # from the prompt's last step

    def follows(self, other: "_Part") -> bool:
        """The same blocks, the layers right after `other`'s: the two can be one message."""
        return (self.first == other.first and self.data.shape[0] == other.data.shape[0]
                and self.layers.start == other.layers.stop)


class LayerStream:
    def __init__(self, request_id: str, params: TransferParams, keys: Sequence[int],
                 num_prompt_tokens: int, backend: str, chain: FallbackChain, limits: WireLimits,
                 kv_caches: Sequence[torch.Tensor], submit: Callable[..., object],
                 on_verdict: Callable[[str, TransferVerdict], None], digests: Sequence[bytes] = (),
                 on_device: bool = False) -> None:
        """`keys`: the store key of each block of the send (for a fallback to a store), and
        `digests` the prefix digest of its leading full blocks (kept with them there);
        `submit(fn)` runs `fn` on a pool thread; `on_verdict(request_id, verdict)` is called
        once, with the stream's verdict, unless the stream is cancelled first. `on_device`:
        the backend moves GPU tensors as they are, so parts stay on the GPU (no host copy)."""
        self.on_device = on_device
        self.request_id = request_id
        self.params = params
        self.keys = tuple(keys)
        self.digests = tuple(digests)
        self.num_prompt_tokens = num_prompt_tokens
        self.backend = backend
        self.endpoint = dict(params.endpoints)[backend]
        self._chain = chain
        self._limits = limits
        self._kv_caches = kv_caches
        self._submit = submit
        self._on_verdict = on_verdict
        self.num_blocks = len(params.dst_block_ids)
        self._next_block = 0  # blocks before it are covered by earlier steps
        self._step: tuple[int, int, torch.Tensor, bool] | None = None  # first, stop, src, final
        self._lock = threading.Lock()
        self._queue: deque[_Part] = deque()
        self._parts: list[_Part] = []
        self._draining = False
        self._forward_end: float | None = None  # set by finish
        self._ended = False  # cancelled or its verdict given
        self.broken: Fallback | None = None
        self._started: float | None = None
        self.num_sent = 0
        self.num_bytes = 0
        self._final_sent = 0  # messages of the last step, and their time
        self._final_s = 0.0

    # -- the engine's thread -------------------------------------------------------------
    def plan_step(self, context: LayerSaveContext) -> None:
        """Which blocks this step sends: those it completes (the last, partial one when the
        prompt ends in it). Blocks a prefix cache or store supplied go with the first step."""
        done = context.num_computed_by_request.get(self.request_id, 0)
        lead = self.params.num_leading_blocks
        final = done >= self.num_prompt_tokens
        stop = self.num_blocks if final else min(done // self._limits.block_size - lead, self.num_blocks)
        first = self._next_block
        self._step = None
        if stop <= first:
            return
        block_ids = context.block_ids_by_request[self.request_id]
        src = block_ids[lead + first:lead + stop]
        self._step = (first, stop, torch.as_tensor(src, dtype=torch.int64), final)

    def add_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        """Layer `layer` of this step is in the cache: in the last step, queue its slice of
        the step's blocks; in an earlier one, queue every layer of them after the last."""
        if self._step is None:
            return
        first, stop, src, final = self._step
        num_layers = self._limits.num_layers
        if final:
            part = self._take(first, layer, kv_layer, src, self.on_device)
        elif layer == num_layers - 1:
            part = _Part(first, range(num_layers), *gather_for_send(self._kv_caches, src.tolist(), self.on_device))
        else:
            return
        if layer == num_layers - 1:
            self._next_block = stop
        with self._lock:
            if self._ended:
                return
            self._parts.append(part)  # kept even once broken: the fallback is built from them
            if self.broken is not None:
                return
            self._queue.append(part)
            start = not self._draining
            self._draining = True
        if start:
            self._submit(self._drain)

    @staticmethod
    def _take(first: int, layer: int, kv_layer: torch.Tensor, src: torch.Tensor, on_device: bool = False) -> _Part:
        """Layer `layer`'s KV of blocks `src` ([n, 1, 2, BS, H, D] on the host, or on the
        GPU for a device-direct backend)."""
        layers = range(layer, layer + 1)
        part = kv_layer.index_select(0, src.to(kv_layer.device)).unsqueeze(1)
        if kv_layer.device.type != "cuda":
            return _Part(first, layers, part, final=True)
        if on_device:  # the sending thread waits for this event, then reads the GPU copy
            ready = torch.cuda.Event()
            ready.record()
            return _Part(first, layers, part, ready, final=True)
        # on a GPU: copy to pinned host memory behind this layer's kernels, without waiting
        host = torch.empty(part.shape, dtype=part.dtype, pin_memory=True)
        host.copy_(part, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return _Part(first, layers, host, ready, final=True)

    def finish(self, forward_end: float) -> None:
        """The prompt's last step is done (every part is queued): the verdict follows when the
        queue is sent (or from the fallback chain if the stream broke)."""
        with self._lock:
            self._forward_end = forward_end
            start = not self._draining and not self._ended
            self._draining = self._draining or start
        if start:
            self._submit(self._drain)

    def cancel(self) -> bool:
        """Stop: nothing more is sent and no verdict comes from the stream. False if the
        verdict was already on its way (finished)."""
        with self._lock:
            if self._ended or self._forward_end is not None:
                return False
            self._ended = True
            self._queue.clear()
            self._parts.clear()
            return True

    @property
    def finished(self) -> bool:
        return self._forward_end is not None

    # -- the pool's thread ---------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            with self._lock:
                batch = [self._queue.popleft()] if self._queue and not self._ended else []
                while batch and self._queue and self._queue[0].follows(batch[-1]):
                    batch.append(self._queue.popleft())  # the sender fell behind: one message
                if not batch:
                    self._draining = False
                    conclude = self._forward_end is not None and not self._ended
                    self._ended = self._ended or conclude
                    break
            self._send(batch)
        if conclude:
            self._conclude()

    def _send(self, batch: list[_Part]) -> None:
        if self.broken is not None:
            return
        start = time.monotonic()
        self._started = self._started or start
        first, n = batch[0].first, batch[0].data.shape[0]
        layers = range(batch[0].layers.start, batch[-1].layers.stop)
        try:
            for part in batch:
                if part.ready is not None:
                    part.ready.synchronize()
            data = batch[0].data if len(batch) == 1 else torch.cat([p.data for p in batch], dim=1)
            message = encode_message(self._limits, self.params.transfer_id,
                                     self.params.dst_block_ids[first:first + n], self.keys[first:first + n],
                                     data, layers)
            self._chain.send_part(self.backend, self.endpoint, message, self.params.monotonic_deadline())
        except Exception as exc:  # refused, unreachable, past the deadline: the chain takes over
            self.broken = Fallback(self.backend, f"stream broke at layers [{layers.start}, {layers.stop}) "
                                   f"of blocks [{first}, {first + n}): {exc.__class__.__name__}: {exc}",
                                   time.monotonic() - start)
            log.warning("transfer %s: %s", self.params.transfer_id.hex()[:12], self.broken.reason)
            return
        self.num_sent += 1
        self.num_bytes += message.nbytes
        if batch[0].final:
            self._final_sent += 1
            self._final_s += time.monotonic() - start

    def _conclude(self) -> None:
        now = time.monotonic()
        if self.broken is None:
            verdict = TransferVerdict(
                self.params.transfer_id.hex(), Landing.LANDED, self.backend, self.num_blocks,
                self.num_bytes, now - (self._started or now), layer_send_s=self.layer_send_s,
                num_messages=self.num_sent)
        else:
            verdict = self._fall_back()
        self._parts.clear()
        self._on_verdict(self.request_id, replace(verdict, tail_s=time.monotonic() - self._forward_end))

    def _fall_back(self) -> TransferVerdict:
        """The whole prompt through the rest of the chain, from the parts kept."""
        try:
            for part in self._parts:
                if part.ready is not None:
                    part.ready.synchronize()
            whole = assemble(self._parts, self.num_blocks, self._limits.num_layers)
            message = encode_message(self._limits, self.params.transfer_id, self.params.dst_block_ids,
                                     self.keys, whole)
            return self._chain.send(SendJob(self.params.transfer_id, message, self.keys,
                                            dict(self.params.endpoints), self.params.backends,
                                            self.params.monotonic_deadline(), self.digests), broken=self.broken)
        except Exception as exc:  # the request must still get a verdict
            return TransferVerdict(self.params.transfer_id.hex(), Landing.MISSING, "",
                                   fallbacks=(self.broken, Fallback("sender", repr(exc))))

    @property
    def layer_send_s(self) -> float:
        """The mean time to send one message of the last step (a layer of its blocks, or the
        few layers that queued while the previous message went)."""
        return self._final_s / self._final_sent if self._final_sent else 0.0


def assemble(parts: Sequence[_Part], num_blocks: int, num_layers: int) -> torch.Tensor:
    """The `[N, L, 2, BS, H, D]` buffer of a whole send from its layer parts. Raises
    ValueError unless the parts cover every layer of every block."""
    if not parts:
        raise ValueError("no parts to assemble")
    sample = parts[0].data
    whole = torch.empty((num_blocks, num_layers, *sample.shape[2:]), dtype=sample.dtype, device=sample.device)
    covered = torch.zeros(num_blocks, num_layers, dtype=torch.bool)
    for part in parts:
        n, layers = part.data.shape[0], slice(part.layers.start, part.layers.stop)
        whole[part.first:part.first + n, layers] = part.data
        covered[part.first:part.first + n, layers] = True
    if not bool(covered.all()):
        raise ValueError(f"the parts cover {int(covered.sum())} of {covered.numel()} block layers")
    return whole


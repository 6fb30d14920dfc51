"""`ucx`: point-to-point KV transfer over UCX (UCXX, the maintained successor of ucx-py): the
link protocol of `_link` with a UCX payload channel.

The hello carries the sender's UCX worker address, the welcome a random connection id and the
receiver's; each side builds its endpoint from the other's, and a payload goes with the tag
(connection id << 32 | seq) straight into the sink's staging buffer. The control connection
stays TCP: ucxx's listener binds every interface, pdserve's bind 127.0.0.1 unless configured.
ucxx keeps one context per process, driven by one asyncio loop: `_Runtime` owns it on a
thread, shared (ref-counted) by the process's transports; the protocol's threads hand each
UCX send and receive to it.

Robustness over a few percent: the default transports are tcp, posix and sysv shared memory,
and self, never cma: with cma a sender killed mid-transfer made UCX abort the receiving
decode (tests/e2e/test_chaos.py). UCX endpoint error handling is off by default: the control
connection, the probe and the deadlines already detect a dead peer. Settings come from
PDSERVE_UCX_* (engine/envs.py).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import importlib.util
import logging
import os
import secrets
import select
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Coroutine

from pdserve.common import envs
from pdserve.common.util import is_loopback
from pdserve.common.errors import TransferError
from pdserve.kvtransfer.backends._channel import Carrier, Channel, Control, Landing, Receive, Sending
from pdserve.kvtransfer.backends._link import P2PTransport
from pdserve.kvtransfer.backends._p2p import CLOSE_TIMEOUT_S, HANDSHAKE_TIMEOUT_S, MAX_HELLO

if importlib.util.find_spec("ucxx") is None:  # checked cheaply; ucxx itself loads on first use
    raise ImportError("the ucx transport needs ucxx (pip install 'pdserve[ucx]', i.e. ucxx-cu12)")

log = logging.getLogger(__name__)

CONN_ID = struct.Struct("<I")  # the welcome: connection id, then the receiver's worker address
ABORT_PERIOD_NS = 500_000_000  # how long aborting a UCX endpoint may wait for UCX
QUARANTINE_S = 30.0  # how long a buffer of an abandoned UCX operation is kept alive
HANGUP_POLL_S = 0.05  # how often a receiver waiting for a payload looks for a hang-up


@dataclass(frozen=True, slots=True)
class UcxSettings:
    """UCX options, fixed when the process's UCX context starts (one per process)."""

    tls: str = "tcp,posix,sysv,self"
    net_devices: str = "lo"
    rndv_thresh: str = "8192"
    tcp_tx_seg_size: str = "256k"
    tcp_rx_seg_size: str = "1m"
    tcp_max_iov: str = "16"
    error_handling: bool = False
    extra: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_env(cls, host: str = "127.0.0.1") -> "UcxSettings":
        tls = envs.get("PDSERVE_UCX_TLS").strip()
        if tls == "auto":
            tls = "tcp,posix,sysv,self" + (",cuda_copy,cuda_ipc" if _has_cuda() else "")
        devices = envs.get("PDSERVE_UCX_NET_DEVICES").strip()
        if devices == "auto":  # keep UCX's own TCP sockets on loopback when we listen there
            devices = "lo" if is_loopback(host) else "all"
        extra = []
        for item in envs.get("PDSERVE_UCX_OPTIONS").split():
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ValueError(f"PDSERVE_UCX_OPTIONS: {item!r} is not KEY=VALUE")
            extra.append((key.removeprefix("UCX_"), value))
        return cls(tls=tls, net_devices=devices, rndv_thresh=envs.get("PDSERVE_UCX_RNDV_THRESH"),
                   tcp_tx_seg_size=envs.get("PDSERVE_UCX_TCP_TX_SEG_SIZE"),
                   tcp_rx_seg_size=envs.get("PDSERVE_UCX_TCP_RX_SEG_SIZE"),
                   error_handling=envs.get_bool("PDSERVE_UCX_ERROR_HANDLING"), extra=tuple(extra))

    def ucx_options(self) -> dict[str, str]:
        """Options handed to the UCX context (they win over UCX_* variables ucxx sets)."""
        options = {"TLS": self.tls, "NET_DEVICES": self.net_devices,
                   "RNDV_THRESH": self.rndv_thresh, "TCP_TX_SEG_SIZE": self.tcp_tx_seg_size,
                   "TCP_RX_SEG_SIZE": self.tcp_rx_seg_size, "TCP_MAX_IOV": self.tcp_max_iov,
                   "WARN_UNUSED_ENV_VARS": "n"}
        options.update(self.extra)
        return options


# Transports that move host memory without registering it: they need no memory hooks.
_HOST_TLS = frozenset({"tcp", "posix", "sysv", "self", "sm", "shm", "mm", "cma"})


def keep_libc_unpatched(tls: str) -> bool:
    """Turn off UCX's memory hooks (`UCX_MEM_EVENTS=no`, unless the environment says otherwise)
    when every transport in `tls` moves host memory unregistered, as the CPU default does.
    Otherwise UCX installs them when its context starts by overwriting the first instructions
    of libc's mmap, munmap, madvise, brk, sbrk and mremap with jumps, while this process's
    other threads (gRPC, a gloo receiver, the engine's allocator) may be running those very
    functions: a worker at start died of SIGSEGV in exactly that window once in CI. The hooks
    only keep a registration cache of RDMA or GPU memory valid; transports that register
    memory (rc, ud, dc, cuda_*) keep them. UCX reads the setting when it is first loaded:
    call this before the process's first `import ucxx`. True when the hooks stay off."""
    if not set(tls.replace(" ", "").split(",")) <= _HOST_TLS:
        return False
    return os.environ.setdefault("UCX_MEM_EVENTS", "no").lower() in ("n", "no", "0", "off", "false")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# -- the process's UCX context and its loop ----------------------------------------------------
MAX_CONN_IDS = 1 << 16  # connection ids remembered as taken (far more than live connections)


class _Runtime:
    """The event loop thread and the ucxx context of this process, shared by its transports."""

    _lock = threading.Lock()
    _current: "_Runtime | None" = None

    def __init__(self, settings: UcxSettings) -> None:
        self.settings = settings
        self.users = 0
        self._conn_ids: collections.OrderedDict[int, None] = collections.OrderedDict()  # handed out, newest last
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="pdkv-ucx-loop",
                                        daemon=True)
        self._thread.start()
        try:
            self.worker_address = self.run(self._init(), HANDSHAKE_TIMEOUT_S)
        except BaseException:
            self._stop_loop()
            raise

    @classmethod
    def acquire(cls, settings: UcxSettings) -> "_Runtime":
        with cls._lock:
            runtime = cls._current
            if runtime is None:
                runtime = cls._current = cls(settings)
            elif runtime.settings != settings:
                raise TransferError("UCX is already running in this process with other settings "
                                    f"({runtime.settings} vs {settings})")
            runtime.users += 1
            return runtime

    def release(self) -> None:
        with _Runtime._lock:
            self.users -= 1
            if self.users > 0:
                return
            _Runtime._current = None
        try:
            self.run(self._reset(), CLOSE_TIMEOUT_S)
        except Exception as exc:  # shutting down must reach the thread join below
            log.warning("ucx: resetting UCX failed: %s", exc)
        self._stop_loop()

    def run(self, coro: Coroutine, timeout_s: float) -> Any:
        """Run `coro` on the loop from another thread and wait for it (cancel it on timeout)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout=max(0.0, timeout_s))
        except concurrent.futures.TimeoutError:
            if future.done():  # the coroutine's own TimeoutError
                raise
            future.cancel()
            raise TimeoutError(f"the ucx loop gave no answer within {timeout_s:.2f}s") from None

    def next_conn_id(self) -> int:
        """A random connection id, unlike the last MAX_CONN_IDS this process's UCX worker
        handed out. Tags are matched per worker, across endpoints: an id no peer can guess
        keeps a peer's payloads out of another connection's posted receives."""
        with _Runtime._lock:  # serving threads of several receivers ask at once
            while not (conn_id := secrets.randbits(32)) or conn_id in self._conn_ids:
                pass
            self._conn_ids[conn_id] = None
            while len(self._conn_ids) > MAX_CONN_IDS:
                self._conn_ids.popitem(last=False)
        return conn_id

    async def _init(self) -> bytes:
        keep_libc_unpatched(self.settings.tls)
        import ucxx  # inside the loop: ucxx binds its progress and notifier to the running loop

        ucxx.init(options=self.settings.ucx_options(), enable_python_future=True,
                  progress_mode="thread")
        return bytes(ucxx.get_worker_address().tobytes())

    async def _reset(self) -> None:
        import ucxx

        abandoned = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in abandoned:  # an operation left behind holds its endpoint, and so UCX
            task.cancel()
        if abandoned:
            await asyncio.wait(abandoned, timeout=CLOSE_TIMEOUT_S)
        ucxx.stop_notifier_thread()
        ucxx.reset()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self.loop.close()


# -- buffers -----------------------------------------------------------------------------------
def _ucx_buffer(obj: object, *, writable: bool) -> object:
    """`obj` as a flat byte buffer UCX can send from / receive into, without a copy (a
    non-contiguous tensor is copied for sending). CUDA tensors and other objects with
    `__cuda_array_interface__` go as device memory."""
    if hasattr(obj, "element_size"):  # a torch tensor, host or device
        import torch

        tensor = obj.detach()
        if not tensor.is_contiguous():
            if writable:
                raise TransferError("the staging tensor is not contiguous")
            tensor = tensor.contiguous()
        flat = tensor.reshape(-1).view(torch.uint8)
        return flat if flat.is_cuda else flat.numpy()
    if hasattr(obj, "__cuda_array_interface__"):
        return obj
    view = memoryview(obj)
    if writable and view.readonly:
        raise TransferError("the staging buffer is read-only")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class _Quarantine:
    """Buffers of UCX operations given up on (deadline, hang-up), kept alive a while.

    Cancelling the asyncio side of a UCX send or receive does not retire the UCX request at
    once: until UCX cancels it (the endpoint's abort, a later progress), it may still read
    or write the buffer. Freed, that memory goes back to Python and torch; a late write
    into it corrupted whatever took it next (a decode died of it under the chaos test).
    """

    def __init__(self) -> None:
        self._held: collections.deque[tuple[float, object]] = collections.deque()
        self._lock = threading.Lock()

    def hold(self, *buffers: object) -> None:
        now = time.monotonic()
        with self._lock:
            self._held.append((now + QUARANTINE_S, buffers))
            while self._held and self._held[0][0] < now:
                self._held.popleft()


_QUARANTINE = _Quarantine()


# -- the channel ---------------------------------------------------------------------------------
class _UcxReceive(Receive):
    def __init__(self, future: concurrent.futures.Future, buffers: tuple) -> None:
        self.future, self.buffers = future, buffers

    def wait(self, deadline: float, control) -> bool:
        while (remaining := deadline - time.monotonic()) > 0:
            done, _ = concurrent.futures.wait([self.future], timeout=min(remaining, HANGUP_POLL_S))
            if done:
                break
            if select.select([control], [], [], 0)[0]:  # the sender hung up
                break
        if not self.future.done():
            self.future.cancel()
            _QUARANTINE.hold(*self.buffers)  # the receive may still land in it
            return False
        try:
            self.future.result()  # a UCX error propagates and drops the link
        except BaseException:
            _QUARANTINE.hold(*self.buffers)
            raise
        return True


class _UcxSending(Sending):
    """A UCX send on the loop; given up (deadline, failure, abandon), its buffers are quarantined:
    UCX may still read them a while."""

    def __init__(self, future: concurrent.futures.Future, buffers: tuple) -> None:
        self.future, self.buffers = future, buffers

    def wait(self, deadline: float) -> None:
        try:
            self.future.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            self.abandon()
            if self.future.done() and not self.future.cancelled():  # the send's own TimeoutError
                raise
            raise TimeoutError("the ucx send did not finish before the deadline") from None
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        self.future.cancel()
        _QUARANTINE.hold(*self.buffers)


class _UcxChannel(Channel):
    """One UCX endpoint; payloads tagged (connection id << 32 | seq)."""

    # A sealed payload crosses as one piece: over UCX, chunks' extra messages cost more than
    # the overlap of sealing and opening with the move wins (bench transfer, ucx+aead).
    sealed_chunk_bytes = 1 << 40

    def __init__(self, runtime: _Runtime, ep, conn_id: int) -> None:
        self.runtime, self.ep, self.conn_id = runtime, ep, conn_id

    def send(self, data: object, seq: int, deadline: float) -> None:
        self.start_send(data, seq, deadline).wait(deadline)

    def start_send(self, data: object, seq: int, deadline: float) -> Sending:
        payload = _ucx_buffer(data, writable=False)
        send = self.ep.send(payload, tag=(self.conn_id << 32) | seq, force_tag=True)
        return _UcxSending(asyncio.run_coroutine_threadsafe(send, self.runtime.loop), (payload, data))

    def landing(self, sink, header) -> Landing:
        staging = sink.staging(header)
        buffer = _ucx_buffer(staging, writable=True)  # flat bytes
        nbytes = buffer.numel() if hasattr(buffer, "element_size") else buffer.nbytes
        if nbytes != header.payload_len:
            raise TransferError(f"staging is {nbytes} bytes, payload {header.payload_len}")
        return Landing(staging, buffer)

    def probe_landing(self, nbytes: int) -> object:
        return _ucx_buffer(bytearray(nbytes), writable=True)

    def post_receive(self, buffer: object, seq: int) -> Receive:
        receive = self.ep.recv(buffer, tag=(self.conn_id << 32) | seq, force_tag=True)
        return _UcxReceive(asyncio.run_coroutine_threadsafe(receive, self.runtime.loop), (buffer,))

    def abort(self) -> None:
        async def abort() -> None:
            self.ep.abort(period=ABORT_PERIOD_NS)

        self.runtime.run(abort(), CLOSE_TIMEOUT_S)


class _UcxCarrier(Carrier):
    name, version = "ucx", 4  # the link protocol's own VERSION covers the payload's format

    def __init__(self, settings: UcxSettings) -> None:
        self.settings = settings
        self.runtime = _Runtime.acquire(settings)

    def hello(self) -> bytes:
        return self.runtime.worker_address

    def welcome(self, hello: bytes) -> bytes:
        if not 0 < len(hello) <= MAX_HELLO:
            raise TransferError("not a pdserve ucx sender (no worker address)")
        return CONN_ID.pack(self.runtime.next_conn_id()) + self.runtime.worker_address

    def open(self, control: Control, hello: bytes, welcome: bytes, deadline: float) -> Channel:
        (conn_id,) = CONN_ID.unpack_from(welcome)
        address = welcome[CONN_ID.size:] if control.is_sender else hello
        if not address:
            raise TransferError("the ucx receiver sent no worker address")
        ep = self.runtime.run(self._endpoint(address), deadline - time.monotonic())
        return _UcxChannel(self.runtime, ep, conn_id)

    async def _endpoint(self, address: bytes):
        import ucxx

        return await ucxx.create_endpoint_from_worker_address(
            ucxx.get_ucx_address_from_buffer(address), endpoint_error_handling=self.settings.error_handling)

    def close(self) -> None:
        self.runtime.release()


class UcxTransport(P2PTransport):
    """KV blocks over UCX. Listens on `host` (127.0.0.1 by default), port `port` (0: any)."""

    name = "ucx"

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 settings: UcxSettings | None = None, key: bytes | None = None) -> None:
        super().__init__(host, port, key)
        self.settings = settings or UcxSettings.from_env(host)

    def new_carrier(self) -> Carrier:
        """This process's UCX context and loop (ucxx.init costs ~1 s the first time)."""
        return _UcxCarrier(self.settings)


def create_transport(config) -> UcxTransport:
    """Registry factory: listens on `config.host`, port `config.transfer_port` (0: any)."""
    return UcxTransport(host=config.host, port=config.transfer_port, key=config.transfer_key)

"""`ucx`: point-to-point KV transfer over UCX (UCXX, the maintained successor of ucx-py).

One message, sender S to receiver R (every TCP frame sealed with the session's tag, `_p2p`)::

    S -> R  TCP  request: prefix (16 B) + header (72 B) + index (16 B per block) + payload tag
    R            sink.check(header, index); post a UCX receive into sink.staging(header)
    R -> S  TCP  reply: accept, or refuse + reason
    S -> R  UCX  payload, tag (connection id << 32 | seq), straight into the staging buffer
    R            the payload's tag checked, then sink.commit(header, index, staging)
    R -> S  TCP  reply: the verdict (ok, or refused + reason)

Accepting: a new connection must answer the challenge within CHALLENGE_TIMEOUT_S; at most
MAX_PENDING wait for that (more are closed at once) and at most MAX_PEERS authenticated
connections are served. asyncio spends no thread on either.

Why a TCP control channel beside UCX: ucxx's listener binds every interface (its Python API
takes a port, not a host), while pdserve listeners bind 127.0.0.1 unless configured. So R
listens with a plain asyncio server on the configured host; the first exchange on a connection
swaps UCX worker addresses and each side builds its UCX endpoint from the other's. UCX then
carries only payload bytes (shared memory, TCP, or CUDA memory); the TCP connection carries
small control frames, and its loss tells either side the peer is gone.

Threads: ucxx keeps one context per process, driven by one asyncio loop. `_Runtime` owns that
loop on a background thread and is shared (ref-counted) by the transports of a process; the
last `close()` resets UCX and joins the thread. `send()` blocks its caller until the verdict
or the deadline; on the deadline the in-flight operation is cancelled (UCX endpoint aborted,
control connection dropped) and the next send to that peer connects afresh. A link idle for
PROBE_IDLE_S or more is probed before its next request (a ping on the control connection and
a few bytes over its UCX endpoint, `_p2p`): a partition leaves no trace on a link until it is
used, and UCX's own connections may have died under a control connection that survived. A
link that fails the probe, or whose receiver hung up, is replaced before the request goes.

Robustness over a few percent: the default transports are tcp, posix and sysv shared
memory, and self, never cma (cross-memory attach, part of UCX's "sm"). With cma a receiver
reads the sender's memory directly, and a sender killed mid-transfer made UCX abort the
receiving decode process (found by tests/e2e/test_chaos.py); `pdserve bench transfer`
compares the two. UCX endpoint error handling (peer failure detection) costs several times
the throughput here; it is off by default because the control connection, the probe before
a reused link and the deadlines already detect a dead peer. Settings come from PDSERVE_UCX_*
(engine/envs.py).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import importlib.util
import logging
import os
import secrets
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Coroutine

from pdserve.common import envs
from pdserve.common.util import is_loopback
from pdserve.common.errors import TransferError
from pdserve.kernels.omp import one_intra_op_thread
from pdserve.kvtransfer.backends import _p2p
from pdserve.kvtransfer.backends._p2p import (  # noqa: F401  (re-exported: shared frames)
    CLOSE_TIMEOUT_S, HANDSHAKE_TIMEOUT_S, MAX_BUDGET_MS, MAX_REASON, REPLY, REQUEST,
    REQUEST_MAGIC, VERSION, _RefusedByPeer,
)
from pdserve.kvtransfer.base import BlockMessage, BlockSink, KVTransport
from pdserve.kvtransfer.wire import HEADER_SIZE

if importlib.util.find_spec("ucxx") is None:  # checked cheaply; ucxx itself loads on first use
    raise ImportError("the ucx transport needs ucxx (pip install 'pdserve[ucx]', i.e. ucxx-cu12)")

log = logging.getLogger(__name__)

# -- hello frames (little-endian); requests and replies are in _p2p ---------------------------
HELLO = struct.Struct("<4sHHI")  # magic, version, flags (0), worker address length
WELCOME = struct.Struct("<4sHHII")  # magic, version, flags (0), connection id, address length
HELLO_MAGIC = b"PDUX"
MAX_ADDRESS = 1 << 16  # a UCX worker address is a few hundred bytes; refuse absurd ones
ABORT_PERIOD_NS = 500_000_000  # how long aborting a UCX endpoint may wait for UCX
QUARANTINE_S = 30.0  # how long a buffer of an abandoned UCX operation is kept alive
_GRACE_S = 1.0  # the calling thread waits this much past the deadline for the loop to answer


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
        while True:
            conn_id = secrets.randbits(32)
            if conn_id and conn_id not in self._conn_ids:
                break
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


def _nbytes(buffer: object) -> int:
    if hasattr(buffer, "element_size"):
        return buffer.numel() * buffer.element_size()
    return buffer.nbytes


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


# -- sender side ---------------------------------------------------------------------------------
class _Link:
    """One sender -> receiver connection: TCP control stream + UCX endpoint."""

    def __init__(self, endpoint: str, reader, writer, ep, conn_id: int, session: _p2p.Session) -> None:
        self.endpoint = endpoint
        self.session = session
        self.reader, self.writer, self.ep = reader, writer, ep
        self.conn_id = conn_id
        self.seq = 0
        self.lock = asyncio.Lock()
        self.closed = False
        self.last_answer = time.monotonic()  # when the receiver last answered on this link

    @classmethod
    async def open(cls, endpoint: str, worker_address: bytes, error_handling: bool,
                   key: bytes | None = None) -> "_Link":
        import ucxx

        host, port = _p2p.split_endpoint(endpoint, "ucx")
        reader, writer = await asyncio.open_connection(host, port)
        try:
            _p2p.keep_alive(writer.get_extra_info("socket"))
            session = await _p2p.authenticate_receiver_stream(reader, writer, key, endpoint)
            writer.write(session.seal(HELLO.pack(HELLO_MAGIC, VERSION, 0, len(worker_address)) + worker_address))
            await writer.drain()
            welcome = await reader.readexactly(WELCOME.size)
            magic, version, flags, conn_id, length = WELCOME.unpack(welcome)
            if magic != HELLO_MAGIC or version != VERSION or flags or not 0 < length <= MAX_ADDRESS:
                raise TransferError(f"{endpoint} is not a pdserve ucx receiver (or another version)")
            rest = await reader.readexactly(length + _p2p.TAG_BYTES)
            address = session.open(welcome + rest[:length], rest[length:])[WELCOME.size:]
            ep = await ucxx.create_endpoint_from_worker_address(
                ucxx.get_ucx_address_from_buffer(address), endpoint_error_handling=error_handling)
        except BaseException:
            writer.close()
            raise
        return cls(endpoint, reader, writer, ep, conn_id, session)

    async def exchange(self, message: BlockMessage, deadline: float) -> None:
        seq, self.seq = self.seq, (self.seq + 1) & 0xFFFFFFFF
        self.writer.write(_p2p.encode_request(self.session, seq, message, deadline))
        await self.writer.drain()
        _p2p.raise_if_refused(await _p2p.read_reply_stream(self.reader, self.session, "ucx"), self.endpoint)
        payload = _ucx_buffer(message.payload, writable=False)
        try:
            await self.ep.send(payload, tag=(self.conn_id << 32) | seq, force_tag=True)
        except BaseException:  # cancelled or failed: UCX may still read the payload a while
            _QUARANTINE.hold(payload, message.payload)
            raise
        _p2p.raise_if_refused(await _p2p.read_reply_stream(self.reader, self.session, "ucx"), self.endpoint)
        self.last_answer = time.monotonic()

    def needs_probe(self) -> bool:
        """True when the link may have died unseen (idle PROBE_IDLE_S or more); the control
        stream at its end (the receiver hung up) is dead, not merely doubtful."""
        if self.reader.at_eof() or self.reader.exception() is not None:
            raise ConnectionError("the receiver closed the control connection")
        return time.monotonic() - self.last_answer >= _p2p.PROBE_IDLE_S

    async def probe(self, deadline: float) -> None:
        """Check both channels: a ping on the control stream, PROBE_BYTES over UCX, the
        receiver's answer. The caller bounds it by `deadline`."""
        seq, self.seq = self.seq, (self.seq + 1) & 0xFFFFFFFF
        self.writer.write(_p2p.encode_ping(self.session, seq, deadline))
        await self.writer.drain()
        _p2p.raise_if_refused(await _p2p.read_reply_stream(self.reader, self.session, "ucx"), self.endpoint)
        payload = _ucx_buffer(bytes(_p2p.PROBE_BYTES), writable=False)
        try:
            await self.ep.send(payload, tag=(self.conn_id << 32) | seq, force_tag=True)
        except BaseException:
            _QUARANTINE.hold(payload)
            raise
        _p2p.raise_if_refused(await _p2p.read_reply_stream(self.reader, self.session, "ucx"), self.endpoint)
        self.last_answer = time.monotonic()

    def abort(self) -> None:
        self.closed = True
        self.writer.close()
        self.ep.abort(period=ABORT_PERIOD_NS)


# -- receiver side -------------------------------------------------------------------------------
class _Receiver:
    """An asyncio server on (host, port); one task per sender connection, at most MAX_PENDING
    of them unauthenticated and MAX_PEERS authenticated."""

    def __init__(self, runtime: _Runtime, sink: BlockSink, error_handling: bool,
                 key: bytes | None = None) -> None:
        self.runtime = runtime
        self.key = key
        self.sink = sink
        self.error_handling = error_handling
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdkv-ucx-sink",
                                       initializer=one_intra_op_thread)
        self.server: asyncio.AbstractServer | None = None
        self.tasks: set[asyncio.Task] = set()
        self.num_pending = 0  # connections that have not proved the key yet
        self.num_peers = 0  # connections that have
        self.num_refused = 0

    async def start(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(self._serve, host, port)
        return self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=CLOSE_TIMEOUT_S)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.num_pending >= _p2p.MAX_PENDING:
            self.num_refused += 1
            writer.close()
            return
        task = asyncio.current_task()
        self.tasks.add(task)
        ep = None
        peer = False
        try:
            _p2p.keep_alive(writer.get_extra_info("socket"))
            self.num_pending += 1
            try:
                session, hello = await asyncio.wait_for(self._authenticate(reader, writer),
                                                        _p2p.CHALLENGE_TIMEOUT_S)
            finally:
                self.num_pending -= 1
            if self.num_peers >= _p2p.MAX_PEERS:
                raise TransferError(f"already serving {self.num_peers} senders")
            self.num_peers += 1
            peer = True
            ep, conn_id = await asyncio.wait_for(self._handshake(reader, writer, session, hello),
                                                 HANDSHAKE_TIMEOUT_S)
            while await self._serve_one(reader, writer, session, ep, conn_id):
                pass
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the sender went away (or we are closing): drop the connection
        except (asyncio.TimeoutError, _p2p.PeerNotAuthenticated) as exc:
            if peer:  # an authenticated sender's request ran past its budget
                log.warning("ucx receiver: dropping a connection: %r", exc)
            else:  # no proof, or none in time
                self.num_refused += 1
        except Exception as exc:  # noqa: BLE001 - one bad peer must not stop the listener
            log.warning("ucx receiver: dropping a connection: %s", exc)
        finally:
            self.num_peers -= peer
            writer.close()
            if ep is not None:
                ep.abort(period=ABORT_PERIOD_NS)
            self.tasks.discard(task)

    async def _authenticate(self, reader, writer) -> tuple[_p2p.Session, bytes]:
        """The session of a sender that proves the key, and the head of its hello (callers bound
        this with CHALLENGE_TIMEOUT_S; keyless, only the hello is awaited)."""
        session = await _p2p.authenticate_sender_stream(reader, writer, self.key)
        return session, await reader.readexactly(HELLO.size)

    async def _handshake(self, reader, writer, session: _p2p.Session, hello: bytes):
        import ucxx

        magic, version, flags, length = HELLO.unpack(hello)
        if magic != HELLO_MAGIC or version != VERSION or flags or not 0 < length <= MAX_ADDRESS:
            raise TransferError("not a pdserve ucx sender (or another version)")
        rest = await reader.readexactly(length + _p2p.TAG_BYTES)
        address = session.open(hello + rest[:length], rest[length:])[HELLO.size:]
        ep = await ucxx.create_endpoint_from_worker_address(
            ucxx.get_ucx_address_from_buffer(address), endpoint_error_handling=self.error_handling)
        conn_id = self.runtime.next_conn_id()
        ours = self.runtime.worker_address
        writer.write(session.seal(WELCOME.pack(HELLO_MAGIC, VERSION, 0, conn_id, len(ours)) + ours))
        await writer.drain()
        return ep, conn_id

    async def _serve_one(self, reader, writer, session: _p2p.Session, ep, conn_id: int) -> bool:
        """Handle one request. False: the connection must be dropped."""
        prefix = await reader.readexactly(REQUEST.size)
        if _p2p.is_ping(prefix):
            return await self._answer_probe(reader, writer, session, ep, conn_id, prefix)
        try:
            seq, budget_s, index_len = _p2p.parse_request(prefix, self.sink.limits)
        except _p2p.MalformedRequest as exc:
            writer.write(_p2p.reply(session, False, str(exc)))
            return False  # cannot resynchronise the stream: drop it
        rest = await asyncio.wait_for(reader.readexactly(_p2p.request_rest_len(index_len)), budget_s)
        try:
            body, payload_tag = _p2p.open_request(session, prefix, rest)
        except _p2p.TamperedFrame as exc:  # say why, then drop: the stream cannot be trusted
            writer.write(_p2p.refusal(session, exc))
            await writer.drain()
            return False
        try:
            header, index = _p2p.parse_body(body, index_len, self.sink.limits)
            await self._call_sink(self.sink.check, header, index)
            staging = self.sink.staging(header)
            buffer = _ucx_buffer(staging, writable=True)
            if _nbytes(buffer) != header.payload_len:
                raise TransferError(f"staging is {_nbytes(buffer)} bytes, payload {header.payload_len}")
        except Exception as exc:  # refused before any payload moved; the stream stays in sync
            writer.write(_p2p.refusal(session, exc))
            await writer.drain()
            return True
        receive = asyncio.ensure_future(ep.recv(buffer, tag=(conn_id << 32) | seq, force_tag=True))
        writer.write(_p2p.reply(session, True))
        await writer.drain()
        try:
            arrived = await self._await_payload(receive, reader, budget_s)
        except BaseException:  # cancelled (closing) or a UCX error
            arrived = False
            raise
        finally:
            if not arrived:
                _QUARANTINE.hold(buffer, staging)  # the receive may still land in it
        if not arrived:
            return False
        try:
            await self._call_sink(session.check_payload, seq, body[:HEADER_SIZE], index, staging, payload_tag)
            await self._call_sink(self.sink.commit, header, index, staging)
        except Exception as exc:  # noqa: BLE001 - the sink's refusal, whatever it is, goes back to the sender
            writer.write(_p2p.refusal(session, exc))
        else:
            writer.write(_p2p.reply(session, True))
        await writer.drain()
        return True

    async def _answer_probe(self, reader, writer, session: _p2p.Session, ep, conn_id: int,
                            prefix: bytes) -> bool:
        """Answer a probe: accept, take PROBE_BYTES over UCX, say ok. False: drop the connection."""
        tag = await asyncio.wait_for(reader.readexactly(_p2p.TAG_BYTES), HANDSHAKE_TIMEOUT_S)
        seq, budget_s = _p2p.open_ping(session, prefix, tag)  # a bad probe drops the connection
        buffer = _ucx_buffer(bytearray(_p2p.PROBE_BYTES), writable=True)
        receive = asyncio.ensure_future(ep.recv(buffer, tag=(conn_id << 32) | seq, force_tag=True))
        writer.write(_p2p.reply(session, True))
        await writer.drain()
        arrived = False
        try:
            arrived = await self._await_payload(receive, reader, budget_s)
        finally:
            if not arrived:
                _QUARANTINE.hold(buffer)  # the receive may still land in it
        if arrived:
            writer.write(_p2p.reply(session, True))
            await writer.drain()
        return arrived

    async def _await_payload(self, receive: asyncio.Future, reader, budget_s: float) -> bool:
        """Wait for the payload, the budget, or the sender hanging up, whichever comes first."""
        hangup = asyncio.ensure_future(reader.read(1))  # the sender sends nothing until the verdict
        try:
            done, _ = await asyncio.wait({receive, hangup}, timeout=budget_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            hangup.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await hangup  # the stream allows one reader at a time: let this one finish
        if receive not in done:
            receive.cancel()
            log.warning("ucx receiver: payload did not arrive (%s)",
                        "sender hung up" if hangup in done else f"budget {budget_s:.2f}s passed")
            return False
        receive.result()  # a UCX error propagates and drops the connection
        return True

    async def _call_sink(self, fn: Callable, *args) -> None:
        await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)


# -- the transport -------------------------------------------------------------------------------
class UcxTransport(KVTransport):
    """KV blocks over UCX. Listens on `host` (127.0.0.1 by default), port `port` (0: any)."""

    name = "ucx"

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 settings: UcxSettings | None = None, key: bytes | None = None) -> None:
        """`key`: the deployment's transfer key; peers must prove they hold it (None: no check)."""
        self.host, self.port = host, port
        self.key = key
        self.settings = settings or UcxSettings.from_env(host)
        self._lock = threading.Lock()
        self._runtime: _Runtime | None = None
        self._receivers: list[_Receiver] = []
        self._links: dict[str, _Link] = {}  # these two are touched on the loop thread only
        self._open_lock: asyncio.Lock | None = None
        self._closed = False

    def open_receiver(self, sink: BlockSink) -> str:
        runtime = self._ensure_runtime()
        receiver = _Receiver(runtime, sink, self.settings.error_handling, self.key)
        with self._lock:
            self._receivers.append(receiver)
        port = runtime.run(receiver.start(self.host, self.port), HANDSHAKE_TIMEOUT_S)
        return _p2p.format_endpoint(self.host, port)

    def send(self, endpoint: str, message: BlockMessage, deadline: float) -> None:
        _p2p.check_payload_len(message)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"ucx send to {endpoint}: the deadline passed before it started")
        runtime = self._ensure_runtime()
        try:
            runtime.run(self._send(endpoint, message, deadline), remaining + _GRACE_S)
        except TimeoutError as exc:
            raise TimeoutError(f"ucx send to {endpoint}: {exc}") from None

    def prepare(self) -> None:
        """Start this process's UCX context and loop (ucxx.init costs ~1 s the first time)."""
        self._ensure_runtime()

    def connect_ahead(self, endpoint: str, deadline: float) -> None:
        """Open the link (control stream + UCX endpoint) a first send would open."""
        runtime = self._ensure_runtime()
        runtime.run(self._link(endpoint), max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            runtime, self._runtime = self._runtime, None
            receivers, self._receivers = self._receivers, []
        if runtime is None:
            return
        try:
            runtime.run(self._shutdown(receivers), CLOSE_TIMEOUT_S)
        except Exception as exc:  # closing must release the runtime regardless
            log.warning("ucx: closing connections failed: %s", exc)
        for receiver in receivers:
            receiver.pool.shutdown(wait=True, cancel_futures=True)
        runtime.release()

    # -- internals ---------------------------------------------------------------------------
    def _ensure_runtime(self) -> _Runtime:
        with self._lock:
            if self._closed:
                raise TransferError("the ucx transport is closed")
            if self._runtime is None:
                self._runtime = _Runtime.acquire(self.settings)
            return self._runtime

    async def _send(self, endpoint: str, message: BlockMessage, deadline: float) -> None:
        try:
            await asyncio.wait_for(self._deliver(endpoint, message, deadline),
                                   deadline - time.monotonic())
        except asyncio.TimeoutError:
            raise TimeoutError("no verdict within the deadline") from None

    async def _deliver(self, endpoint: str, message: BlockMessage, deadline: float) -> None:
        while True:
            link = await self._link(endpoint)
            async with link.lock:
                if link.closed:  # a send before us dropped it: connect afresh
                    continue
                if not await self._checked(link, deadline):  # dropped: connect afresh
                    continue
                try:
                    await link.exchange(message, deadline)
                    return
                except _RefusedByPeer:
                    raise
                except BaseException as exc:  # timeout, cancel, peer gone: the link is unusable
                    self._drop(link)
                    if isinstance(exc, (OSError, asyncio.IncompleteReadError)):
                        raise TransferError(f"ucx peer {endpoint} went away: {exc!r}") from exc
                    raise

    async def _checked(self, link: _Link, deadline: float) -> bool:
        """Whether `link` may carry a request now: a link that may have died unseen answers a
        probe first (within PROBE_TIMEOUT_S, and `deadline`); one that does not is dropped."""
        try:
            if link.needs_probe():
                probe_by = _p2p.probe_deadline(deadline)
                await asyncio.wait_for(link.probe(probe_by), probe_by - time.monotonic())
            return True
        except BaseException as exc:  # a probe cut short leaves the stream out of step: drop it
            self._drop(link)
            if not isinstance(exc, Exception):  # cancelled: the send's deadline
                raise
            log.info("ucx: the link to %s failed its check (%r); reconnecting", link.endpoint, exc)
            return False

    async def _link(self, endpoint: str) -> _Link:
        if self._open_lock is None:
            self._open_lock = asyncio.Lock()
        async with self._open_lock:
            link = self._links.get(endpoint)
            if link is None:
                try:
                    link = await _Link.open(endpoint, self._runtime_address(),
                                            self.settings.error_handling, self.key)
                except OSError as exc:
                    raise TransferError(f"ucx peer {endpoint} unreachable: {exc}") from exc
                except asyncio.IncompleteReadError as exc:
                    raise TransferError(f"ucx peer {endpoint} hung up during the handshake") from exc
                self._links[endpoint] = link
            return link

    def _runtime_address(self) -> bytes:
        runtime = self._runtime
        if runtime is None:
            raise TransferError("the ucx transport is closed")
        return runtime.worker_address

    def _drop(self, link: _Link) -> None:
        if self._links.get(link.endpoint) is link:
            del self._links[link.endpoint]
        try:
            link.abort()
        except Exception as exc:  # noqa: BLE001 - the link is being dropped anyway
            log.debug("ucx: aborting a link: %s", exc)

    async def _shutdown(self, receivers: list[_Receiver]) -> None:
        for link in list(self._links.values()):
            self._drop(link)
        for receiver in receivers:
            await receiver.close()
        await asyncio.sleep(0)  # let cancelled handlers run their cleanup


def create_transport(config) -> UcxTransport:
    """Registry factory: listens on `config.host`, port `config.transfer_port` (0: any)."""
    return UcxTransport(host=config.host, port=config.transfer_port, key=config.transfer_key)

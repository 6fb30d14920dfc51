"""`nccl`: point-to-point KV transfer over torch.distributed, one process group per
(sender, receiver) pair: NCCL between CUDA devices, gloo on CPU.

Pairing: the receiver listens on (host, port) with a plain TCP socket and runs a TCPStore
server on a second, ephemeral port of the same host. A sender connects, says which backend it
speaks, and gets the store's port and a pair number; both then build a two-rank process group
(sender rank 0, receiver rank 1) on a PrefixStore of that pair. The group is constructed
directly (`ProcessGroupGloo(store, rank, 2, options)`), so torch.distributed's global default
group is never initialised and any number of pairs can coexist in one process.

One message on a pair, sequence n::

    S -> R  TCP  request: prefix (16 B) + header (64 B) + index (16 B per block)
    R            sink.check(header, index)
    R -> S  TCP  reply: accept, or refuse + reason
    S -> R  PG   payload: uint8 tensor send/recv (tag n) into sink.staging(header)
    R            sink.commit(header, index, staging)
    R -> S  TCP  reply: the verdict

Why control does not go through the group: a gloo wait cannot be interrupted (neither
`abort()` nor `shutdown()` wakes it) and a gloo timeout breaks the pair, so the receiver posts
a group receive only when a payload is announced, bounded by that message's budget. Why not
through the TCPStore either: a store client connecting to a peer that accepts and never
answers hangs past its timeout. The control socket has deadlines on every read, and its loss
tells either side that the pair is gone; the next send pairs afresh.
"""
from __future__ import annotations

import datetime
import itertools
import logging
import select
import socket
import struct
import threading
import time

from pdserve.engine import envs
from pdserve.engine.errors import TransferError
from pdserve.kvtransfer.base import BlockMessage, BlockSink, KVTransport
from pdserve.kvtransfer.wire import HEADER, HEADER_SIZE, INDEX_ENTRY_SIZE, parse_header

log = logging.getLogger(__name__)

HELLO = struct.Struct("<4sHH8s")  # magic, version, flags (0), backend name (NUL padded)
PAIRING = struct.Struct("<II")  # store port, pair number (after an accepting reply)
REQUEST = struct.Struct("<4sIII")  # magic, seq, budget ms, index length
REPLY = struct.Struct("<BBH")  # ok, reserved (0), reason length; then the reason (UTF-8)
HELLO_MAGIC, REQUEST_MAGIC, VERSION = b"PDNC", b"PDRQ", 1
BACKENDS = ("gloo", "nccl")
MAX_REASON = 1024
MAX_BUDGET_MS = 600_000
HANDSHAKE_TIMEOUT_S = 10.0  # pairing and a request's bytes once it started arriving
POLL_S = 0.25  # how often idle receiver threads look at the close flag
CLOSE_TIMEOUT_S = 10.0


def default_backend() -> str:
    """PDSERVE_NCCL_BACKEND, or for auto: nccl where CUDA is available, else gloo."""
    name = envs.get("PDSERVE_NCCL_BACKEND").strip().lower()
    if name == "auto":
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"
    if name not in BACKENDS:
        raise ValueError(f"PDSERVE_NCCL_BACKEND={name!r}: choose gloo, nccl or auto")
    return name


# -- sockets with deadlines ---------------------------------------------------------------------
def _recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"peer sent {got} of {n} bytes before the deadline")
        sock.settimeout(remaining)
        try:
            k = sock.recv_into(view[got:])
        except socket.timeout:
            continue
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(buf)


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("deadline passed before sending")
    sock.settimeout(remaining)
    try:
        sock.sendall(data)
    except socket.timeout:
        raise TimeoutError("peer did not take our bytes before the deadline") from None


def _reply(ok: bool, reason: str = "") -> bytes:
    text = reason.encode("utf-8", "replace")[:MAX_REASON]
    return REPLY.pack(1 if ok else 0, 0, len(text)) + text


def _read_reply(sock: socket.socket, deadline: float) -> tuple[bool, str]:
    ok, reserved, length = REPLY.unpack(_recv_exactly(sock, REPLY.size, deadline))
    if ok not in (0, 1) or reserved or length > MAX_REASON:
        raise TransferError("malformed reply from the nccl peer")
    return ok == 1, _recv_exactly(sock, length, deadline).decode("utf-8", "replace")


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TransferError(f"bad nccl endpoint {endpoint!r}: expected host:port")
    return host, int(port)


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, seconds))


# -- process groups -------------------------------------------------------------------------------
def _new_group(backend: str, store_host: str, store_port: int, pair_no: int, rank: int,
               local_host: str, timeout_s: float):
    """A two-rank group of its own (the default group is never touched); blocks until both
    ranks joined or `timeout_s` passed. gloo listens on `local_host` (the address the control
    connection uses on this side, so the peer can reach it)."""
    import torch.distributed as dist

    client = dist.TCPStore(store_host, store_port, None, False, timeout=_timedelta(timeout_s),
                           use_libuv=True)
    store = dist.PrefixStore(f"pdkv/pair{pair_no}/", client)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = _timedelta(timeout_s)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        options._threads = 1
        return dist.ProcessGroupGloo(store, rank, 2, options)
    if not dist.is_nccl_available():
        raise TransferError("this torch build has no NCCL (use the gloo backend)")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = _timedelta(timeout_s)
    return dist.ProcessGroupNCCL(store, rank, 2, options)


def _payload_tensor(payload: object, backend: str):
    """The message payload as a flat uint8 tensor on the backend's device."""
    import torch

    if hasattr(payload, "element_size"):
        tensor = payload.detach().contiguous().reshape(-1).view(torch.uint8)
    else:
        view = memoryview(payload)
        view = view if view.format == "B" and view.ndim == 1 else view.cast("B")
        # torch wants a writable buffer; a read-only one (bytes) is copied once
        tensor = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)
    if backend == "nccl" and not tensor.is_cuda:
        tensor = tensor.cuda()
    elif backend == "gloo" and tensor.is_cuda:
        tensor = tensor.cpu()
    return tensor


def _staging_tensor(staging: object):
    """The sink's staging buffer as a flat writable uint8 tensor (shares its memory)."""
    import torch

    if hasattr(staging, "element_size"):
        if not staging.is_contiguous():
            raise TransferError("the staging tensor is not contiguous")
        return staging.detach().reshape(-1).view(torch.uint8)
    view = memoryview(staging)
    if view.readonly:
        raise TransferError("the staging buffer is read-only")
    return torch.frombuffer(view.cast("B") if view.format != "B" else view, dtype=torch.uint8)


def _settle(work, tensor, deadline: float) -> None:
    """Wait for a send/recv until `deadline`; on CUDA also until its stream is done with
    `tensor` (a NCCL wait may only order streams)."""
    work.wait(_timedelta(deadline - time.monotonic()))
    if tensor.is_cuda:
        import torch

        torch.cuda.current_stream(tensor.device).synchronize()


def _declared_payload_len(message: BlockMessage) -> int:
    if len(message.header) != HEADER_SIZE:
        raise TransferError(f"header is {len(message.header)} bytes, not {HEADER_SIZE}")
    return HEADER.unpack(message.header)[11]


# -- sender side ---------------------------------------------------------------------------------
class _Pair:
    """The sender's half of a pair: control socket + process group (rank 0)."""

    def __init__(self, endpoint: str, sock: socket.socket, group, backend: str) -> None:
        self.endpoint, self.sock, self.group, self.backend = endpoint, sock, group, backend
        self.seq = 0
        self.lock = threading.Lock()
        self.closed = False

    @classmethod
    def open(cls, endpoint: str, backend: str, deadline: float) -> "_Pair":
        host, port = _split_endpoint(endpoint)
        remaining = deadline - time.monotonic()
        try:
            sock = socket.create_connection((host, port), timeout=max(0.001, remaining))
        except socket.timeout:
            raise TimeoutError(f"connecting to {endpoint} took past the deadline") from None
        except OSError as exc:
            raise TransferError(f"nccl peer {endpoint} unreachable: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _send_all(sock, HELLO.pack(HELLO_MAGIC, VERSION, 0, backend.encode()), deadline)
            ok, reason = _read_reply(sock, deadline)
            if not ok:
                raise TransferError(f"{endpoint} refused to pair: {reason}")
            store_port, pair_no = PAIRING.unpack(_recv_exactly(sock, PAIRING.size, deadline))
            group = _new_group(backend, host, store_port, pair_no, 0, sock.getsockname()[0],
                               deadline - time.monotonic())
        except BaseException:
            sock.close()
            raise
        return cls(endpoint, sock, group, backend)

    def exchange(self, message: BlockMessage, deadline: float) -> None:
        seq, self.seq = self.seq, (self.seq + 1) & 0x7FFFFFFF
        budget_ms = int(min(MAX_BUDGET_MS, max(1.0, (deadline - time.monotonic()) * 1000)))
        _send_all(self.sock, REQUEST.pack(REQUEST_MAGIC, seq, budget_ms, len(message.index))
                  + message.header + message.index, deadline)
        ok, reason = _read_reply(self.sock, deadline)
        if not ok:
            raise _RefusedByPeer(f"refused by {self.endpoint}: {reason}")
        tensor = _payload_tensor(message.payload, self.backend)
        try:
            _settle(self.group.send([tensor], 1, seq), tensor, deadline)
        except RuntimeError as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"payload not taken before the deadline: {exc}") from None
            raise TransferError(f"payload send failed: {exc}") from exc
        ok, reason = _read_reply(self.sock, deadline)
        if not ok:
            raise _RefusedByPeer(f"refused by {self.endpoint}: {reason}")

    def close(self) -> None:
        """Tear the pair down: the receiver sees the socket close; the group's connections
        close with the object, which ends any wait the receiver has on it."""
        self.closed = True
        self.sock.close()
        self.group = None


class _RefusedByPeer(TransferError):
    """The receiver answered and said no; the pair stays usable."""


# -- receiver side -------------------------------------------------------------------------------
class _Receiver:
    """Accepts pairings on a listening socket; one thread per pair serves its messages."""

    def __init__(self, sink: BlockSink, host: str, port: int, backend: str) -> None:
        import torch.distributed as dist

        self.sink, self.host, self.backend = sink, host, backend
        self.listener = socket.create_server((host, port), backlog=64)
        store_socket = socket.create_server((host, 0), backlog=64)
        self.store_port = store_socket.getsockname()[1]
        try:
            self.store = dist.TCPStore(host, self.store_port, None, True, timeout=_timedelta(30),
                                       wait_for_workers=False, use_libuv=True,
                                       master_listen_fd=store_socket.fileno())
        except BaseException:
            store_socket.close()
            self.listener.close()
            raise
        store_socket.detach()  # the store server owns the descriptor now
        self._pair_nos = itertools.count(1)
        self._stop = threading.Event()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._accept_thread = threading.Thread(target=self._accept, name="pdkv-nccl-accept",
                                               daemon=True)
        self._accept_thread.start()

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    def close(self) -> None:
        self._stop.set()
        self._accept_thread.join(timeout=CLOSE_TIMEOUT_S)
        self.listener.close()
        with self._lock:
            threads = list(self._threads)
        deadline = time.monotonic() + MAX_BUDGET_MS / 1000
        for thread in threads:  # idle ones notice within POLL_S; busy ones within their budget
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.store = None  # the last reference: the store server stops

    def _accept(self) -> None:
        self.listener.settimeout(POLL_S)
        while not self._stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(sock,), name="pdkv-nccl-pair",
                                      daemon=True)
            with self._lock:
                self._threads.add(thread)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        group = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            group = self._pair(sock)
            while group is not None and not self._stop.is_set():
                if not self._wait_readable(sock):
                    continue
                if not self._serve_one(sock, group):
                    break
        except (ConnectionError, TimeoutError, OSError):
            pass  # the sender went away or broke off: drop the pair
        except Exception as exc:
            log.warning("nccl receiver: dropping a pair: %s", exc)
        finally:
            sock.close()
            group = None
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _pair(self, sock: socket.socket):
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        magic, version, flags, name = HELLO.unpack(_recv_exactly(sock, HELLO.size, deadline))
        if magic != HELLO_MAGIC or version != VERSION or flags:
            raise TransferError("not a pdserve nccl sender (or another version)")
        backend = name.rstrip(b"\0").decode("ascii", "replace")
        if backend != self.backend:
            _send_all(sock, _reply(False, f"backend mismatch: sender {backend}, receiver "
                                          f"{self.backend}"), deadline)
            return None
        pair_no = next(self._pair_nos)
        _send_all(sock, _reply(True) + PAIRING.pack(self.store_port, pair_no), deadline)
        return _new_group(self.backend, self.host, self.store_port, pair_no, 1,
                          sock.getsockname()[0], deadline - time.monotonic())

    def _wait_readable(self, sock: socket.socket) -> bool:
        readable, _, _ = select.select([sock], [], [], POLL_S)
        return bool(readable)

    def _serve_one(self, sock: socket.socket, group) -> bool:
        """Handle one request. False: the pair must be dropped."""
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        magic, seq, budget_ms, index_len = REQUEST.unpack(_recv_exactly(sock, REQUEST.size, deadline))
        max_index = self.sink.limits.max_blocks * INDEX_ENTRY_SIZE
        if magic != REQUEST_MAGIC or index_len > max_index or seq > 0x7FFFFFFF:
            _send_all(sock, _reply(False, f"malformed request (index of {index_len} bytes, at "
                                          f"most {max_index})"), deadline)
            return False  # cannot resynchronise the stream
        budget_s = min(MAX_BUDGET_MS, max(1, budget_ms)) / 1000
        deadline = time.monotonic() + budget_s
        body = _recv_exactly(sock, HEADER_SIZE + index_len, deadline)
        header_bytes, index = body[:HEADER_SIZE], body[HEADER_SIZE:]
        try:
            header = parse_header(header_bytes, self.sink.limits)
            if header.index_len != index_len:
                raise TransferError(f"index is {index_len} bytes, the header implies {header.index_len}")
            self.sink.check(header, index)
            staging = self.sink.staging(header)
            target = _staging_tensor(staging)
            if target.numel() != header.payload_len:
                raise TransferError(f"staging is {target.numel()} bytes, payload {header.payload_len}")
        except Exception as exc:  # refused before any payload moved; the stream stays in sync
            _send_all(sock, _reply(False, str(exc) or exc.__class__.__name__), deadline)
            return True
        landing = target.cuda() if self.backend == "nccl" and not target.is_cuda else target
        _send_all(sock, _reply(True), deadline)
        try:
            _settle(group.recv([landing], 0, seq), landing, deadline)
        except RuntimeError as exc:  # a gloo timeout or error breaks the pair
            log.warning("nccl receiver: payload did not arrive: %s", exc)
            return False
        if landing is not target:
            target.copy_(landing)
        try:
            self.sink.commit(header, index, staging)
        except Exception as exc:
            _send_all(sock, _reply(False, str(exc) or exc.__class__.__name__), deadline)
        else:
            _send_all(sock, _reply(True), deadline)
        return True


# -- the transport -------------------------------------------------------------------------------
class NcclTransport(KVTransport):
    """KV blocks over a per-pair torch.distributed group. Listens on `host` (127.0.0.1 by
    default), port `port` (0: any). `backend`: gloo, nccl, or None for PDSERVE_NCCL_BACKEND."""

    name = "nccl"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, backend: str | None = None) -> None:
        self.host, self.port = host, port
        self.backend = backend or default_backend()
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {self.backend!r}")
        import torch.distributed as dist

        if not (dist.is_gloo_available() if self.backend == "gloo" else dist.is_nccl_available()):
            raise TransferError(f"this torch build has no {self.backend} process groups")
        self._lock = threading.Lock()
        self._pairs: dict[str, _Pair] = {}
        self._opening: dict[str, threading.Lock] = {}
        self._receivers: list[_Receiver] = []
        self._closed = False

    def open_receiver(self, sink: BlockSink) -> str:
        with self._lock:
            if self._closed:
                raise TransferError("the nccl transport is closed")
            receiver = _Receiver(sink, self.host, self.port, self.backend)
            self._receivers.append(receiver)
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{receiver.port}"

    def send(self, endpoint: str, message: BlockMessage, deadline: float) -> None:
        declared = _declared_payload_len(message)
        if message.payload_nbytes != declared:
            raise TransferError(f"payload is {message.payload_nbytes} bytes, its header says {declared}")
        while True:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nccl send to {endpoint}: the deadline passed")
            pair = self._pair(endpoint, deadline)
            if not pair.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"nccl send to {endpoint}: the pair stayed busy until the deadline")
            try:
                if pair.closed:
                    continue  # a send before us dropped it: pair afresh
                try:
                    pair.exchange(message, deadline)
                    return
                except _RefusedByPeer:
                    raise
                except BaseException as exc:  # timeout, peer gone: the pair is unusable
                    self._drop(pair)
                    if isinstance(exc, TimeoutError):
                        raise TimeoutError(f"nccl send to {endpoint}: {exc}") from None
                    if isinstance(exc, OSError):
                        raise TransferError(f"nccl peer {endpoint} went away: {exc}") from exc
                    raise
            finally:
                pair.lock.release()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pairs, self._pairs = list(self._pairs.values()), {}
            receivers, self._receivers = self._receivers, []
        for pair in pairs:
            pair.close()
        for receiver in receivers:
            receiver.close()

    def _pair(self, endpoint: str, deadline: float) -> _Pair:
        with self._lock:
            if self._closed:
                raise TransferError("the nccl transport is closed")
            pair = self._pairs.get(endpoint)
            if pair is not None:
                return pair
            opening = self._opening.setdefault(endpoint, threading.Lock())
        if not opening.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"nccl send to {endpoint}: pairing did not finish before the deadline")
        try:
            with self._lock:
                pair = self._pairs.get(endpoint)
            if pair is None:
                pair = _Pair.open(endpoint, self.backend, deadline)
                with self._lock:
                    if self._closed:
                        pair.close()
                        raise TransferError("the nccl transport is closed")
                    self._pairs[endpoint] = pair
            return pair
        except TimeoutError as exc:
            raise TimeoutError(f"pairing with {endpoint}: {exc}") from None
        except (OSError, RuntimeError) as exc:  # peer gone; torch.distributed store/rendezvous
            if time.monotonic() >= deadline:
                raise TimeoutError(f"pairing with {endpoint} did not finish: {exc}") from None
            raise TransferError(f"pairing with {endpoint} failed: {exc}") from exc
        finally:
            opening.release()

    def _drop(self, pair: _Pair) -> None:
        with self._lock:
            if self._pairs.get(pair.endpoint) is pair:
                del self._pairs[pair.endpoint]
        pair.close()


def create_transport(config) -> NcclTransport:
    """Registry factory. Listens on `config.host`; with a fixed `config.transfer_port` the
    nccl receiver takes the next port (ucx takes the port itself)."""
    port = config.transfer_port + 1 if config.transfer_port else 0
    return NcclTransport(host=config.host, port=port)

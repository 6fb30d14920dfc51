"""`nccl`: point-to-point KV transfer over torch.distributed, one process group per
(sender, receiver) pair: NCCL between CUDA devices, gloo on CPU.

Pairing: the receiver listens on (host, port) with a plain TCP socket, its only listener. A
sender connects, proves the transfer key, and says which backend it speaks; both then build a
two-rank process group (sender rank 0, receiver rank 1) whose store is the control connection
itself (`_rendezvous.PairStore`: keys travel as sealed frames, there is no store server), move
PROBE_BYTES over it (NCCL connects on its first payload) and close the rendezvous. The group is
constructed directly (`ProcessGroupGloo(store, rank, 2, options)`), so torch.distributed's
global default group is never initialised and any number of pairs can coexist in one process.

What the groups themselves listen on: a gloo device binds a TCP listener on the control
connection's local address for as long as its group lives (one per pair, both sides), to which
one rank connects, naming the pair by a small, guessable sequence number. gloo authenticates
nobody and keeps every connection it accepts (a descriptor each, 8 bytes read, the rest left
in the kernel), so `_listeners` filters that listener in the kernel: packets from the peer's
host only while the pair connects (the rendezvous, milliseconds), none once it is connected.
What is left: during that window a process on the peer's host (any local process, when both
share a host) could take the pair's place; the bytes it sent instead of the peer's fail the
payload MAC, so it can break that pairing, not forge KV. On NCCL the unique id (its
bootstrap listener's address and random magic, which that listener demands of whoever
connects) travels only on the control connection; NCCL's other listeners (proxy, and the
socket transport between hosts without RDMA) are NCCL's own and are not filtered here.

One message on a pair, sequence n (every TCP frame sealed with the session's tag, `_p2p`)::

    S -> R  TCP  request: prefix (16 B) + header (72 B) + index (16 B per block) + payload tag
    R            sink.check(header, index)
    R -> S  TCP  reply: accept, or refuse + reason
    S -> R  PG   payload: uint8 tensor send/recv (tag n) into sink.staging(header)
    R            the payload's tag checked, then sink.commit(header, index, staging)
    R -> S  TCP  reply: the verdict

On NCCL (CUDA) the payload goes device to device and is never read by the host: the sender
gathers the blocks into a GPU tensor (`blocks.gather_for_send`: this transport is
`device_direct`), tags the payload's NH digest (`kernels.digest`, computed on the GPU; 64 bytes
per 4 MiB cross to the host), and the receiver lands it in a GPU staging tensor of the sink
(`staging(header, on_device=True)`), checks the tag and the header's digest checksum there,
and the sink scatters it into the cache on the GPU. gloo (CPU) is unchanged: host tensors,
Poly1305 over the bytes.

Accepting: `_gate.Gate` runs the challenge of every new connection on one thread (at most
MAX_PENDING waiting, CHALLENGE_TIMEOUT_S each); a pair gets its own thread only once it proved
the key, at most MAX_PEERS of them.

Why control does not go through the group: a gloo wait cannot be interrupted (neither
`abort()` nor `shutdown()` wakes it) and a gloo timeout breaks the pair, so the receiver posts
a group receive only when a payload is announced, bounded by that message's budget. Why not
through a store server either: a TCPStore takes any client's keys, and a store client
connecting to a peer that accepts and never answers hangs past its timeout. The control socket
has deadlines on every read, and its loss tells either side that the pair is gone; the next
send pairs afresh. A pair idle for PROBE_IDLE_S or more is probed before its next request (a
ping on the control socket and a few bytes over the group, `_p2p`); one that fails the probe,
or whose receiver hung up, is replaced before the request goes.
"""
from __future__ import annotations

import datetime
import logging
import select
import socket
import struct
import threading
import time

from pdserve.common import envs
from pdserve.common.errors import TransferError
from pdserve.kernels.omp import one_intra_op_thread
from pdserve.kvtransfer.backends import _gate, _p2p
from pdserve.kvtransfer.backends._p2p import (  # noqa: F401  (re-exported: shared frames)
    CLOSE_TIMEOUT_S, HANDSHAKE_TIMEOUT_S, MAX_BUDGET_MS, MAX_REASON, REPLY, REQUEST,
    REQUEST_MAGIC, _RefusedByPeer,
)
from pdserve.kvtransfer.backends._p2p import recv_exactly, send_all
from pdserve.kvtransfer.base import BlockMessage, BlockSink, KVTransport
from pdserve.kvtransfer.wire import HEADER_SIZE

log = logging.getLogger(__name__)

# hello frames (little-endian); requests and replies are in _p2p
HELLO = struct.Struct("<4sHH8s")  # magic, version, flags (0), backend name (NUL padded)
HELLO_MAGIC = b"PDNC"
HELLO_VERSION = 4  # _p2p.VERSION's frames, paired through the control connection (3: a TCPStore)
BACKENDS = ("gloo", "nccl")
MAX_SEQ = 0x7FFFFFFF  # tags of torch.distributed send/recv are signed ints
FIRST_TAG = MAX_SEQ  # the pairing's first bytes; requests count from 0 after them
POLL_S = 0.25  # how often idle receiver threads look at the close flag


def default_backend() -> str:
    """PDSERVE_NCCL_BACKEND, or for auto: nccl where CUDA is available, else gloo."""
    name = envs.get("PDSERVE_NCCL_BACKEND").strip().lower()
    if name == "auto":
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"
    if name not in BACKENDS:
        raise ValueError(f"PDSERVE_NCCL_BACKEND={name!r}: choose gloo, nccl or auto")
    return name


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, seconds))


# -- process groups -------------------------------------------------------------------------------
def _new_group(backend: str, store, rank: int, local_host: str, timeout_s: float):
    """A two-rank group of its own on `store` (the default group is never touched); blocks
    until both ranks joined or `timeout_s` passed. gloo listens on `local_host` (the address
    the control connection uses on this side, so the peer can reach it)."""
    import torch.distributed as dist

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


def _pair_group(backend: str, sock: socket.socket, session: _p2p.Session, rank: int, deadline: float):
    """The pair's group, met through the control connection (`_rendezvous.PairStore`): built,
    its first PROBE_BYTES moved from rank 0 to rank 1 (NCCL builds its communicator on the
    first payload, while the store is still open), then the rendezvous closed. Both sides call
    this right after the accepting hello reply; on return the connection carries requests.
    On gloo, the device's listener admits only the peer's host until then, nobody after
    (`_listeners`)."""
    import torch

    from pdserve.kvtransfer.backends import _listeners, _rendezvous

    peer_host = sock.getpeername()[0]
    guard = (lambda value: _listeners.admit_only([value], peer_host)) if backend == "gloo" else (lambda value: 0)
    store = _rendezvous.PairStore(sock, session, deadline, before_publish=guard)
    group = _new_group(backend, store, rank, sock.getsockname()[0], deadline - time.monotonic())
    if rank == 0:
        tensor = _payload_tensor(bytes(_p2p.PROBE_BYTES), backend)
        _settle(group.send([tensor], 1, FIRST_TAG), tensor, deadline)
    else:
        tensor = torch.empty(_p2p.PROBE_BYTES, dtype=torch.uint8, device="cuda" if backend == "nccl" else "cpu")
        _settle(group.recv([tensor], 0, FIRST_TAG), tensor, deadline)
    store.finish(deadline)
    if backend == "gloo":  # connected: gloo's listener admits nobody from now on
        _listeners.admit_none(store.published)
    return group


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


# -- sender side ---------------------------------------------------------------------------------
class _Pair:
    """The sender's half of a pair: control socket + process group (rank 0)."""

    def __init__(self, endpoint: str, sock: socket.socket, session: _p2p.Session, group,
                 backend: str) -> None:
        self.endpoint, self.sock, self.group, self.backend = endpoint, sock, group, backend
        self.session = session
        self.seq = 0
        self.lock = threading.Lock()
        self.closed = False
        self.last_answer = time.monotonic()  # when the receiver last answered on this pair

    @classmethod
    def open(cls, endpoint: str, backend: str, deadline: float, key: bytes | None = None) -> "_Pair":
        host, port = _p2p.split_endpoint(endpoint, "nccl")
        remaining = deadline - time.monotonic()
        try:
            sock = socket.create_connection((host, port), timeout=max(0.001, remaining))
        except socket.timeout:
            raise TimeoutError(f"connecting to {endpoint} took past the deadline") from None
        except OSError as exc:
            raise TransferError(f"nccl peer {endpoint} unreachable: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _p2p.keep_alive(sock)
            session = _p2p.authenticate_receiver(sock, key, endpoint, deadline)
            send_all(sock, session.seal(HELLO.pack(HELLO_MAGIC, HELLO_VERSION, 0, backend.encode())), deadline)
            ok, reason = _p2p.read_reply(sock, session, deadline, "nccl")
            if not ok:
                raise TransferError(f"{endpoint} refused to pair: {reason}")
            group = _pair_group(backend, sock, session, 0, deadline)
        except BaseException:
            sock.close()
            raise
        return cls(endpoint, sock, session, group, backend)

    def exchange(self, message: BlockMessage, deadline: float) -> None:
        seq, self.seq = self.seq, (self.seq + 1) & MAX_SEQ
        tensor = _payload_tensor(message.payload, self.backend)
        request = _p2p.encode_request(self.session, seq, message, deadline, payload=tensor,
                                      on_device=tensor.is_cuda)
        send_all(self.sock, request, deadline)
        _p2p.raise_if_refused(_p2p.read_reply(self.sock, self.session, deadline, "nccl"), self.endpoint)
        try:
            _settle(self.group.send([tensor], 1, seq), tensor, deadline)
        except RuntimeError as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"payload not taken before the deadline: {exc}") from None
            raise TransferError(f"payload send failed: {exc}") from exc
        _p2p.raise_if_refused(_p2p.read_reply(self.sock, self.session, deadline, "nccl"), self.endpoint)
        self.last_answer = time.monotonic()

    def needs_probe(self) -> bool:
        """True when the pair may have died unseen (idle PROBE_IDLE_S or more). The receiver
        speaks only when asked: a readable control socket means it hung up."""
        readable, _, _ = select.select([self.sock], [], [], 0)
        if readable:
            raise ConnectionError("the receiver closed the control connection")
        return time.monotonic() - self.last_answer >= _p2p.PROBE_IDLE_S

    def probe(self, deadline: float) -> None:
        """Check both channels by `deadline`: a ping on the control socket, PROBE_BYTES over
        the group, the receiver's answer."""
        seq, self.seq = self.seq, (self.seq + 1) & MAX_SEQ
        send_all(self.sock, _p2p.encode_ping(self.session, seq, deadline), deadline)
        _p2p.raise_if_refused(_p2p.read_reply(self.sock, self.session, deadline, "nccl"), self.endpoint)
        tensor = _payload_tensor(bytes(_p2p.PROBE_BYTES), self.backend)
        _settle(self.group.send([tensor], 1, seq), tensor, deadline)
        _p2p.raise_if_refused(_p2p.read_reply(self.sock, self.session, deadline, "nccl"), self.endpoint)
        self.last_answer = time.monotonic()

    def close(self) -> None:
        """Tear the pair down: the receiver sees the socket close; the group's connections
        close with the object, which ends any wait the receiver has on it."""
        self.closed = True
        self.sock.close()
        self.group = None


# -- receiver side -------------------------------------------------------------------------------
class _Receiver:
    """Accepts pairings through a `_gate.Gate`; one thread per authenticated pair (at most
    MAX_PEERS) serves its messages."""

    def __init__(self, sink: BlockSink, host: str, port: int, backend: str, key: bytes | None = None) -> None:
        self.sink, self.host, self.backend, self.key = sink, host, backend, key
        self.listener = socket.create_server((host, port), backlog=64)
        self._stop = threading.Event()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self.gate = _gate.Gate(self.listener, key, self._admit, name="pdkv-nccl-accept")

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    def close(self) -> None:
        self._stop.set()
        self.gate.close(CLOSE_TIMEOUT_S)
        self.listener.close()
        with self._lock:
            threads = list(self._threads)
        deadline = time.monotonic() + MAX_BUDGET_MS / 1000
        for thread in threads:  # idle ones notice within POLL_S; busy ones within their budget
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _admit(self, sock: socket.socket, session: _p2p.Session) -> None:
        """An authenticated connection (the gate's thread): its own thread, room permitting."""
        with self._lock:
            if len(self._threads) >= _p2p.MAX_PEERS or self._stop.is_set():
                raise TransferError(f"already serving {len(self._threads)} pairs")
            thread = threading.Thread(target=self._serve, args=(sock, session),
                                      name="pdkv-nccl-pair", daemon=True)
            self._threads.add(thread)
        try:
            thread.start()
        except BaseException:  # cannot start a thread now: this connection is closed, the gate goes on
            with self._lock:
                self._threads.discard(thread)
            raise

    def _serve(self, sock: socket.socket, session: _p2p.Session) -> None:
        one_intra_op_thread()  # it scatters received blocks into the cache beside the engine
        group = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _p2p.keep_alive(sock)
            group = self._pair(sock, session)
            while group is not None and not self._stop.is_set():
                if not self._wait_readable(sock):
                    continue
                if not self._serve_one(sock, session, group):
                    break
        except (ConnectionError, TimeoutError, OSError):
            pass  # the sender went away or broke off: drop the pair
        except Exception as exc:  # noqa: BLE001 - one bad peer must not stop the listener
            log.warning("nccl receiver: dropping a pair: %s", exc)
        finally:
            sock.close()
            group = None
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _pair(self, sock: socket.socket, session: _p2p.Session):
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        hello = _p2p.recv_sealed(sock, session, HELLO.size, deadline)
        magic, version, flags, name = HELLO.unpack(hello)
        if magic != HELLO_MAGIC or version != HELLO_VERSION or flags:
            raise TransferError("not a pdserve nccl sender (or another version)")
        backend = name.rstrip(b"\0").decode("ascii", "replace")
        if backend != self.backend:
            send_all(sock, _p2p.reply(session, False, f"backend mismatch: sender {backend}, "
                                                      f"receiver {self.backend}"), deadline)
            return None
        send_all(sock, _p2p.reply(session, True), deadline)
        return _pair_group(self.backend, sock, session, 1, deadline)

    def _wait_readable(self, sock: socket.socket) -> bool:
        readable, _, _ = select.select([sock], [], [], POLL_S)
        return bool(readable)

    def _serve_one(self, sock: socket.socket, session: _p2p.Session, group) -> bool:
        """Handle one request. False: the pair must be dropped."""
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        prefix = recv_exactly(sock, REQUEST.size, deadline)
        if _p2p.is_ping(prefix):
            return self._answer_probe(sock, session, group, prefix, deadline)
        try:
            seq, budget_s, index_len = _p2p.parse_request(prefix, self.sink.limits, MAX_SEQ)
        except _p2p.MalformedRequest as exc:
            send_all(sock, _p2p.reply(session, False, str(exc)), deadline)
            return False  # cannot resynchronise the stream
        deadline = time.monotonic() + budget_s
        try:
            body, payload_tag = _p2p.open_request(
                session, prefix, recv_exactly(sock, _p2p.request_rest_len(index_len), deadline))
        except _p2p.TamperedFrame as exc:  # say why, then drop: the stream cannot be trusted
            send_all(sock, _p2p.refusal(session, exc), deadline)
            return False
        try:
            header, index = _p2p.parse_body(body, index_len, self.sink.limits)
            self.sink.check(header, index)
            staging = self.sink.staging(header, on_device=True) if self.backend == "nccl" else self.sink.staging(header)
            target = _staging_tensor(staging)
            if target.numel() != header.payload_len:
                raise TransferError(f"staging is {target.numel()} bytes, payload {header.payload_len}")
        except Exception as exc:  # refused before any payload moved; the stream stays in sync
            send_all(sock, _p2p.refusal(session, exc), deadline)
            return True
        landing = target.cuda() if self.backend == "nccl" and not target.is_cuda else target
        if not _accept_and_receive(sock, session, group, landing, seq, deadline, "payload"):
            return False
        try:
            session.check_payload(seq, body[:HEADER_SIZE], index, landing, payload_tag, on_device=landing.is_cuda)
            if landing is not target:  # a sink that stages in host memory
                target.copy_(landing)
            self.sink.commit(header, index, staging)
        except Exception as exc:  # noqa: BLE001 - the sink's refusal, whatever it is, goes back to the sender
            send_all(sock, _p2p.refusal(session, exc), deadline)
        else:
            send_all(sock, _p2p.reply(session, True), deadline)
        return True

    def _answer_probe(self, sock: socket.socket, session: _p2p.Session, group, prefix: bytes,
                      deadline: float) -> bool:
        """Answer a probe: accept, take PROBE_BYTES over the group, say ok. False: drop the pair."""
        import torch

        seq, budget_s = _p2p.open_ping(session, prefix, recv_exactly(sock, _p2p.TAG_BYTES, deadline), MAX_SEQ)
        deadline = time.monotonic() + budget_s
        landing = torch.empty(_p2p.PROBE_BYTES, dtype=torch.uint8,
                              device="cuda" if self.backend == "nccl" else "cpu")
        if not _accept_and_receive(sock, session, group, landing, seq, deadline, "a probe's bytes"):
            return False
        send_all(sock, _p2p.reply(session, True), deadline)
        return True


def _accept_and_receive(sock: socket.socket, session: _p2p.Session, group, landing, seq: int,
                        deadline: float, what: str) -> bool:
    """Tell the sender to go, then take its bytes over the group into `landing`. False when
    they did not arrive: a gloo timeout or error breaks the pair, which the caller drops."""
    send_all(sock, _p2p.reply(session, True), deadline)
    try:
        _settle(group.recv([landing], 0, seq), landing, deadline)
    except RuntimeError as exc:
        log.warning("nccl receiver: %s did not arrive: %s", what, exc)
        return False
    return True


# -- the transport -------------------------------------------------------------------------------
class NcclTransport(KVTransport):
    """KV blocks over a per-pair torch.distributed group. Listens on `host` (127.0.0.1 by
    default), port `port` (0: any). `backend`: gloo, nccl, or None for PDSERVE_NCCL_BACKEND."""

    name = "nccl"

    @property
    def device_direct(self) -> bool:
        """On NCCL, GPU payloads go device to device: senders should keep them there."""
        return self.backend == "nccl"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, backend: str | None = None,
                 key: bytes | None = None) -> None:
        """`key`: the deployment's transfer key; peers must prove they hold it (None: no check)."""
        self.host, self.port = host, port
        self.key = key
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
            receiver = _Receiver(sink, self.host, self.port, self.backend, self.key)
            self._receivers.append(receiver)
        return _p2p.format_endpoint(self.host, receiver.port)

    def send(self, endpoint: str, message: BlockMessage, deadline: float) -> None:
        _p2p.check_payload_len(message)
        while True:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nccl send to {endpoint}: the deadline passed")
            pair = self._pair(endpoint, deadline)
            if not pair.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"nccl send to {endpoint}: the pair stayed busy until the deadline")
            try:
                if pair.closed:
                    continue  # a send before us dropped it: pair afresh
                if not self._checked(pair, deadline):
                    continue  # dropped: pair afresh
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

    def _checked(self, pair: _Pair, deadline: float) -> bool:
        """Whether `pair` may carry a request now: a pair that may have died unseen answers a
        probe first (within PROBE_TIMEOUT_S, and `deadline`); one that does not is dropped."""
        try:
            if pair.needs_probe():
                pair.probe(_p2p.probe_deadline(deadline))
            return True
        except Exception as exc:  # noqa: BLE001 - timeout, hang-up, a group error: replace the pair
            log.info("nccl: the pair with %s failed its check (%r); pairing afresh", pair.endpoint, exc)
            self._drop(pair)
            return False

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
                pair = _Pair.open(endpoint, self.backend, deadline, self.key)
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
    return NcclTransport(host=config.host, port=port, key=config.transfer_key)

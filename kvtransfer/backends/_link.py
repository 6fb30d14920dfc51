"""The link protocol of the point-to-point transports, written once: the sender's pool of links
and the receiver's control server. A transport adds only its payload channel (`_channel`).

A link is one TCP control connection from sender S to receiver R plus the channel opened over
it. Everything but payload bytes travels on the control connection, as sealed frames (`_p2p`,
`security.transfer_session`): the challenge, the hellos (which name the transport and its
version, and carry what its channel needs to connect), then per message a request, an
accepting reply, the payload on the channel (keyed: sealed in chunks that are sealed, moved
and opened in a pipeline, `_payload`), and the verdict.

Concurrency: threads and blocking sockets, every read and write under a deadline. The sender
runs on its caller's thread; a link carries one message at a time (its lock), and a send that
fails in any way but a refusal drops the link: the next send opens a fresh one. A link idle for
PROBE_IDLE_S or more may have died unseen (a partition sends no reset; a channel's own
connections may time out while the control connection survives), so it answers a probe (a
ping on the control connection, PROBE_BYTES over the channel) within PROBE_TIMEOUT_S before it
carries a request, or is replaced. The receiver speaks only when asked: a control connection
that turns readable while idle means the receiver hung up.

Admission: `_gate.Gate` runs the challenge of every new connection on one thread (at most
MAX_PENDING waiting, CHALLENGE_TIMEOUT_S each, no thread of their own); a link gets its own
serving thread only once it proved the key, at most MAX_PEERS of them per receiver.
"""
from __future__ import annotations

import logging
import select
import socket
import threading
import time

from pdserve.common.errors import TransferError
from pdserve.kernels.omp import one_intra_op_thread
from pdserve.kvtransfer.backends import _gate, _p2p, _payload
from pdserve.kvtransfer.backends._channel import Carrier, Channel, Control, Landing
from pdserve.kvtransfer.base import BlockMessage, BlockSink, KVTransport
from pdserve.kvtransfer.wire import HEADER_SIZE

log = logging.getLogger(__name__)

POLL_S = 0.25  # how often an idle serving thread looks at its close flag


# -- sender side ---------------------------------------------------------------------------------
class _Link:
    """The sender's half of a link: control connection + channel; used under `lock` only."""

    def __init__(self, endpoint: str, control: Control, channel: Channel) -> None:
        self.endpoint, self.control, self.channel = endpoint, control, channel
        self.seq = 0
        self.lock = threading.Lock()
        self.closed = False
        self.last_answer = time.monotonic()  # when the receiver last answered on this link
        self.scratch = _payload.Scratch(_payload.host_buffer)  # where this link's payloads are sealed

    def _next_seq(self, count: int = 1) -> int:
        """The next seq, and `count` in all taken (a payload's chunks use seq .. seq + count - 1)."""
        seq, self.seq = self.seq, (self.seq + count) & self.channel.max_seq
        return seq

    def _answer(self, deadline: float) -> None:
        reply = _p2p.read_reply(self.control.sock, self.control.session, deadline, "link")
        _p2p.raise_if_refused(reply, self.endpoint)

    def exchange(self, message: BlockMessage, deadline: float) -> None:
        session, nbytes = self.control.session, message.payload_nbytes
        chunk_bytes = self.channel.sealed_chunk_bytes
        seq = self._next_seq(len(_payload.chunk_spans(session, nbytes, chunk_bytes)))
        cipher = (session.payload_sealer(seq, message.header, message.index, nbytes, chunk_bytes)
                  if session.is_keyed else None)  # bound to the request sealed next
        request = _p2p.encode_request(session, seq, message, deadline)
        _p2p.send_all(self.control.sock, request, deadline)
        self._answer(deadline)
        _payload.send_payload(self.channel, session, message.payload, cipher, seq, self.scratch,
                              deadline)
        self._answer(deadline)
        self.last_answer = time.monotonic()

    def needs_probe(self) -> bool:
        """True when idle PROBE_IDLE_S or more; ConnectionError when the receiver hung up."""
        readable, _, _ = select.select([self.control.sock], [], [], 0)
        if readable:
            raise ConnectionError("the receiver closed the control connection")
        return time.monotonic() - self.last_answer >= _p2p.PROBE_IDLE_S

    def probe(self, deadline: float) -> None:
        """A ping on the control connection, PROBE_BYTES over the channel, the receiver's ok."""
        seq = self._next_seq()
        _p2p.send_all(self.control.sock, _p2p.encode_ping(self.control.session, seq, deadline), deadline)
        self._answer(deadline)
        data = self.channel.outgoing(bytes(_p2p.PROBE_BYTES))
        self.channel.send(data, seq, deadline)
        self._answer(deadline)
        self.last_answer = time.monotonic()

    def close(self) -> None:
        self.closed = True
        self.control.sock.close()
        try:
            self.channel.abort()
        except Exception as exc:  # noqa: BLE001 - the link is being dropped anyway
            log.debug("aborting a channel: %s", exc)


def _open_link(transport: "P2PTransport", endpoint: str, deadline: float) -> _Link:
    """Connect, prove the key, exchange hellos, open the channel: a link ready for requests."""
    carrier, name = transport.carrier(), transport.name
    host, port = _p2p.split_endpoint(endpoint, name)
    try:
        sock = socket.create_connection((host, port), timeout=max(0.001, deadline - time.monotonic()))
    except TimeoutError:
        raise TimeoutError(f"connecting to {endpoint} took past the deadline") from None
    except OSError as exc:
        raise TransferError(f"{name} peer {endpoint} unreachable: {exc}") from exc
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _p2p.keep_alive(sock)
        session = _p2p.authenticate_receiver(sock, transport.key, endpoint, deadline)
        hello = carrier.hello()
        _p2p.send_all(sock, _p2p.encode_hello(session, name, carrier.version, hello), deadline)
        welcome = _p2p.read_welcome(sock, session, endpoint, name, deadline)
        control = Control(sock, session, is_sender=True)
        return _Link(endpoint, control, carrier.open(control, hello, welcome, deadline))
    except BaseException:
        sock.close()
        raise


class LinkPool:
    """The sender's links, one per receiver endpoint: opened on first use, probed when idle,
    dropped on any failure but a refusal."""

    def __init__(self, transport: "P2PTransport") -> None:
        self.transport = transport
        self._lock = threading.Lock()
        self._links: dict[str, _Link] = {}
        self._opening: dict[str, threading.Lock] = {}
        self._closed = False

    def send(self, endpoint: str, message: BlockMessage, deadline: float) -> None:
        what = f"{self.transport.name} send to {endpoint}"
        while True:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what}: the deadline passed")
            link = self.link(endpoint, deadline)
            if not link.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"{what}: the link stayed busy until the deadline")
            try:
                if link.closed or not self._checked(link, deadline):
                    continue  # dropped (by us, or a send before us): connect afresh
                try:
                    link.exchange(message, deadline)
                    return
                except _p2p._RefusedByPeer:
                    raise
                except BaseException as exc:  # timeout, peer gone: the link is unusable
                    self._drop(link)
                    if isinstance(exc, TimeoutError):
                        raise TimeoutError(f"{what}: {exc}") from None
                    if isinstance(exc, OSError):
                        raise TransferError(f"{self.transport.name} peer {endpoint} went away: {exc}") from exc
                    raise
            finally:
                link.lock.release()

    def _checked(self, link: _Link, deadline: float) -> bool:
        """Whether `link` may carry a request now: one that may have died unseen answers a probe
        first (within PROBE_TIMEOUT_S, and `deadline`); one that does not is dropped."""
        try:
            if link.needs_probe():
                link.probe(_p2p.probe_deadline(deadline))
            return True
        except Exception as exc:  # noqa: BLE001 - timeout, hang-up, a channel error: replace the link
            log.info("%s: the link to %s failed its check (%r); reconnecting", self.transport.name,
                     link.endpoint, exc)
            self._drop(link)
            return False

    def link(self, endpoint: str, deadline: float) -> _Link:
        """The link to `endpoint`, opened now if there is none (one opener per endpoint)."""
        with self._lock:
            if self._closed:
                raise TransferError(f"the {self.transport.name} transport is closed")
            link = self._links.get(endpoint)
            if link is not None:
                return link
            opening = self._opening.setdefault(endpoint, threading.Lock())
        if not opening.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"connecting to {endpoint} did not finish before the deadline")
        try:
            with self._lock:
                link = self._links.get(endpoint)
            if link is None:
                link = _open_link(self.transport, endpoint, deadline)
                with self._lock:
                    if self._closed:
                        link.close()
                        raise TransferError(f"the {self.transport.name} transport is closed")
                    self._links[endpoint] = link
            return link
        except TimeoutError as exc:
            raise TimeoutError(f"connecting to {endpoint}: {exc}") from None
        except (OSError, RuntimeError) as exc:  # peer gone; a channel's own set-up failing
            if time.monotonic() >= deadline:
                raise TimeoutError(f"connecting to {endpoint} did not finish: {exc}") from None
            raise TransferError(f"connecting to {endpoint} failed: {exc!r}") from exc
        finally:
            opening.release()

    def _drop(self, link: _Link) -> None:
        with self._lock:
            if self._links.get(link.endpoint) is link:
                del self._links[link.endpoint]
        link.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()


# -- receiver side -------------------------------------------------------------------------------
class ControlServer:
    """Accepts links through a `_gate.Gate`; one thread per authenticated link (at most
    MAX_PEERS) serves its requests and probes."""

    def __init__(self, carrier: Carrier, sink: BlockSink, host: str, port: int, key: bytes | None) -> None:
        self.carrier, self.sink, self.name = carrier, sink, carrier.name
        self.listener = socket.create_server((host, port), backlog=64)
        self._stop = threading.Event()
        self._threads: set[threading.Thread] = set()
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.gate = _gate.Gate(self.listener, key, self._admit, name=f"pdkv-{self.name}-accept")

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    def close(self) -> None:
        self._stop.set()
        self.gate.close(_p2p.CLOSE_TIMEOUT_S)
        self.listener.close()
        with self._lock:
            threads, socks = list(self._threads), list(self._socks)
        for sock in socks:  # wakes serving threads blocked on their control connection
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + _p2p.MAX_BUDGET_MS / 1000
        for thread in threads:  # idle ones notice at once; busy ones within their budget
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _admit(self, sock: socket.socket, session: _p2p.Session) -> None:
        """An authenticated connection (the gate's thread): its own thread, room permitting."""
        with self._lock:
            if len(self._threads) >= _p2p.MAX_PEERS or self._stop.is_set():
                raise TransferError(f"already serving {len(self._threads)} links")
            thread = threading.Thread(target=self._serve, args=(sock, session),
                                      name=f"pdkv-{self.name}-link", daemon=True)
            self._threads.add(thread)
            self._socks.add(sock)
        try:
            thread.start()
        except BaseException:  # cannot start a thread now: this connection is closed, the gate goes on
            with self._lock:
                self._threads.discard(thread)
                self._socks.discard(sock)
            raise

    def _serve(self, sock: socket.socket, session: _p2p.Session) -> None:
        one_intra_op_thread()  # it scatters received blocks into the cache beside the engine
        channel = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _p2p.keep_alive(sock)
            channel = self._handshake(sock, session)
            scratch = _payload.Scratch(channel.probe_landing) if channel is not None else None
            while channel is not None and not self._stop.is_set():
                readable, _, _ = select.select([sock], [], [], POLL_S)
                if readable and not self._serve_one(sock, session, channel, scratch):
                    break
        except (ConnectionError, TimeoutError, OSError):
            pass  # the sender went away or broke off: drop the link
        except Exception as exc:  # noqa: BLE001 - one bad peer must not stop the listener
            log.warning("%s receiver: dropping a link: %s", self.name, exc)
        finally:
            sock.close()
            if channel is not None:
                channel.abort()
            with self._lock:
                self._threads.discard(threading.current_thread())
                self._socks.discard(sock)

    def _handshake(self, sock: socket.socket, session: _p2p.Session) -> Channel | None:
        """The sender's hello, our welcome, the channel; None (after saying why) on a refusal."""
        deadline = time.monotonic() + _p2p.HANDSHAKE_TIMEOUT_S
        try:
            hello = _p2p.read_hello(sock, session, self.name, self.carrier.version, deadline)
            welcome = self.carrier.welcome(hello)
        except TransferError as exc:
            _p2p.send_all(sock, _p2p.refusal(session, exc), deadline)
            return None
        _p2p.send_all(sock, _p2p.encode_welcome(session, welcome), deadline)
        return self.carrier.open(Control(sock, session, is_sender=False), hello, welcome, deadline)

    def _serve_one(self, sock: socket.socket, session: _p2p.Session, channel: Channel,
                   scratch: "_payload.Scratch") -> bool:
        """Handle one request. False: the link must be dropped."""
        deadline = time.monotonic() + _p2p.HANDSHAKE_TIMEOUT_S
        prefix = _p2p.recv_exactly(sock, _p2p.REQUEST.size, deadline)
        if _p2p.is_ping(prefix):
            return self._answer_probe(sock, session, channel, prefix, deadline)
        try:
            seq, budget_s, index_len = _p2p.parse_request(prefix, self.sink.limits, channel.max_seq)
        except _p2p.MalformedRequest as exc:
            _p2p.send_all(sock, _p2p.refusal(session, exc), deadline)
            return False  # cannot resynchronise the stream
        deadline = time.monotonic() + budget_s
        try:
            rest = _p2p.recv_exactly(sock, _p2p.request_rest_len(index_len), deadline)
            body = _p2p.open_request(session, prefix, rest)
        except _p2p.TamperedFrame as exc:  # say why, then drop: the stream cannot be trusted
            _p2p.send_all(sock, _p2p.refusal(session, exc), deadline)
            return False
        try:
            header, index = _p2p.parse_body(body, index_len, self.sink.limits)
            self.sink.check(header, index)
            landing, opening = self._landing(session, channel, seq, body, header, index, scratch)
        except Exception as exc:  # noqa: BLE001 - refused before any payload moved; the stream stays in sync
            _p2p.send_all(sock, _p2p.refusal(session, exc), deadline)
            return True
        pieces, arrived = (opening.pieces(), opening.arrived) if opening else ([landing.buffer], None)
        if not self._receive(sock, session, channel, pieces, seq, deadline, "the payload", arrived):
            return False
        try:
            if opening is not None:  # every chunk opened into the staging, or refused: nothing lands
                opening.check()
            landing.finish()
            self.sink.commit(header, index, landing.staging)
        except Exception as exc:  # noqa: BLE001 - the sink's refusal, whatever it is, goes back to the sender
            _p2p.send_all(sock, _p2p.refusal(session, exc), deadline)
        else:
            _p2p.send_all(sock, _p2p.reply(session, True), deadline)
        return True

    def _landing(self, session: _p2p.Session, channel: Channel, seq: int, body: bytes, header,
                 index: bytes, scratch: "_payload.Scratch") -> tuple[Landing, "_payload.Opening | None"]:
        """Keyless: the channel's own landing. Keyed: the sealed chunks land in the link's
        scratch (a buffer of the channel's) and are opened, as each arrives, into the sink's
        host staging (`_payload.Opening`)."""
        if not session.is_keyed:
            return channel.landing(self.sink, header), None
        staging = self.sink.staging(header)
        spans = _payload.chunk_spans(session, header.payload_len, channel.sealed_chunk_bytes)
        buffer = scratch.take(spans[-1][1].stop)
        opening = _payload.Opening(session, seq, body[:HEADER_SIZE], index, header.payload_len,
                                   buffer, staging, channel.sealed_chunk_bytes)
        return Landing(staging, buffer), opening

    def _answer_probe(self, sock: socket.socket, session: _p2p.Session, channel: Channel,
                      prefix: bytes, deadline: float) -> bool:
        """Accept, take PROBE_BYTES over the channel, say ok. False: drop the link."""
        tag = _p2p.recv_exactly(sock, _p2p.TAG_BYTES, deadline)
        seq, budget_s = _p2p.open_ping(session, prefix, tag, channel.max_seq)  # a bad probe drops the link
        deadline = time.monotonic() + budget_s
        buffer = channel.probe_landing(_p2p.PROBE_BYTES)
        if not self._receive(sock, session, channel, [buffer], seq, deadline, "a probe's bytes"):
            return False
        _p2p.send_all(sock, _p2p.reply(session, True), deadline)
        return True

    def _receive(self, sock: socket.socket, session: _p2p.Session, channel: Channel, pieces: list,
                 seq: int, deadline: float, what: str, arrived=None) -> bool:
        """Post a receive for each piece (under seq, seq + 1, ...), tell the sender to go, wait
        for the pieces in order, handing each to `arrived(k)` as it lands (the next one keeps
        arriving meanwhile). False when one did not arrive (deadline, hang-up): the caller
        drops the link."""
        receives = []
        try:
            for k, piece in enumerate(pieces):
                receives.append(channel.post_receive(piece, (seq + k) & channel.max_seq))
            _p2p.send_all(sock, _p2p.reply(session, True), deadline)
            for k in range(len(receives)):
                receive, receives[k] = receives[k], None
                if not receive.wait(deadline, sock):
                    log.warning("%s receiver: %s did not arrive (by the deadline, or the sender "
                                "hung up)", self.name, what)
                    return False
                if arrived is not None:
                    arrived(k)
            return True
        finally:
            for receive in receives:  # abandoned: the channel retires them
                if receive is not None:
                    try:
                        receive.wait(0.0, sock)
                    except Exception as exc:  # noqa: BLE001 - the link is dropped anyway
                        log.debug("abandoning a receive: %s", exc)


# -- the transport -------------------------------------------------------------------------------
class P2PTransport(KVTransport):
    """A point-to-point transport: this protocol over the channels of `new_carrier()`. Listens
    on `host` (127.0.0.1 by default), port `port` (0: any). `key`: the deployment's transfer
    key; peers must prove they hold it (None: no check). The carrier opens on first use."""

    connects_ahead = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0, key: bytes | None = None) -> None:
        self.host, self.port, self.key = host, port, key
        self._lock = threading.Lock()
        self._carrier: Carrier | None = None
        self._receivers: list[ControlServer] = []
        self._pool = LinkPool(self)
        self._closed = False

    def new_carrier(self) -> Carrier:
        raise NotImplementedError

    def carrier(self) -> Carrier:
        with self._lock:
            if self._closed:
                raise TransferError(f"the {self.name} transport is closed")
            if self._carrier is None:
                self._carrier = self.new_carrier()
            return self._carrier

    def open_receiver(self, sink: BlockSink) -> str:
        server = ControlServer(self.carrier(), sink, self.host, self.port, self.key)
        with self._lock:
            self._receivers.append(server)
        return _p2p.format_endpoint(self.host, server.port)

    def send(self, endpoint: str, message: BlockMessage, deadline: float) -> None:
        _p2p.check_payload_len(message)
        self._pool.send(endpoint, message, deadline)

    def prepare(self) -> None:
        self.carrier()

    def connect_ahead(self, endpoint: str, deadline: float) -> None:
        """Open the link a first send would open (where `connects_ahead`)."""
        if self.connects_ahead:
            self._pool.link(endpoint, deadline)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            carrier, self._carrier = self._carrier, None
            receivers, self._receivers = self._receivers, []
        self._pool.close()
        for receiver in receivers:
            receiver.close()
        if carrier is not None:
            carrier.close()

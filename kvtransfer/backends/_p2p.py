"""The control protocol shared by the point-to-point transports (`ucx`, `nccl`).

Each transport carries payload bytes on its own channel (UCX, a process group) and everything
else on one TCP control connection from sender S to receiver R (nccl's process-group
rendezvous included: `_rendezvous`). With a transfer key (from the
cluster secret) each connection starts with a mutual challenge-response, before the
transport's hello and before either side reads anything else::

    R -> S  challenge c (32 random bytes)
    S -> R  nonce n (32 random bytes) + HMAC-SHA256(key, "s2r" c n)
    R -> S  HMAC-SHA256(key, "r2s" n c)       (R closes the connection if S's proof fails)

The answer is due within CHALLENGE_TIMEOUT_S. Both sides then hold a session key,
HMAC-SHA256(key, "session" c n), fresh for this connection (`Session`). Every later frame in
either direction (hellos, requests, replies) ends with a 32-byte tag, HMAC-SHA256(session key,
direction, frame number, frame): a frame altered, dropped, replayed or reordered fails its
tag and the connection is dropped. Each request carries its payload's tag: Poly1305 over the
payload under the one-time key HMAC-SHA256(session key, "payload" seq, header, index) (the
header names the transfer); R checks it on the bytes that arrived before the sink sees them,
and refuses the transfer otherwise. Without a key (`--insecure-internal`)
there is no challenge and the frames' tags use a fixed public key: they catch corruption,
not an attacker; payloads then carry an all-zero tag (the sink checks their checksum).

After the transport's own hello, every message on a connection is (all integers
little-endian; each frame then its tag)::

    S -> R  request  REQUEST (16 B): magic b"PDRQ", seq, budget ms, index length
                     + wire header (72 B) + index (16 B per block) + payload tag (16 B)
    R -> S  reply    REPLY (4 B): ok, reserved 0, reason length; + reason (UTF-8, <= 1 KiB)
    S -> R  payload  on the transport's channel, only after an accepting reply
    R -> S  reply    the verdict: ok, or refused + reason

A connection idle for PROBE_IDLE_S or more may have died unseen (a partition sends no reset;
a transport's own connections may time out while the control connection survives), so the
sender checks it before reuse with a probe, answered within PROBE_TIMEOUT_S or the
connection is replaced::

    S -> R  ping     REQUEST (16 B) with magic b"PDPG", index length 0
    R -> S  reply    accept
    S -> R  payload  PROBE_BYTES on the transport's channel
    R -> S  reply    ok

The budget (capped at MAX_BUDGET_MS) bounds how long R waits for the payload. A refusal
before the payload keeps the stream in sync; a malformed request cannot be resynchronised, so
R answers it and drops the connection. Reads come in two kinds: blocking sockets with a
deadline (nccl) and asyncio streams (ucx, whose callers bound them with `wait_for`).

Work before authentication is bounded: a receiver keeps at most MAX_PENDING connections
waiting for their challenge's answer (more are closed at once), spends no thread on them, and
serves at most MAX_PEERS authenticated connections.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import socket
import struct
import time

from pdserve.common.errors import TransferError
from pdserve.kvtransfer.base import BlockMessage
from pdserve.kvtransfer.wire import (
    HEADER_SIZE, INDEX_ENTRY_SIZE, BlockHeader, WireLimits, declared_payload_len, parse_header,
)

REQUEST = struct.Struct("<4sIII")  # magic, seq, budget ms, index length
REPLY = struct.Struct("<BBH")  # ok, reserved (0), reason length; then the reason (UTF-8)
REQUEST_MAGIC, VERSION = b"PDRQ", 3  # these frames' version: ucx's hello carries it, nccl's its own
PING_MAGIC = b"PDPG"  # a probe of the connection: a REQUEST prefix with no index
PROBE_BYTES = 8  # what a probe sends on the transport's channel
PROBE_IDLE_S = 1.0  # a connection idle this long is probed before its next request
PROBE_TIMEOUT_S = 2.0  # a probe unanswered this long: the connection is replaced
MAX_REASON = 1024
MAX_BUDGET_MS = 600_000  # a receiver waits at most this long for one payload
HANDSHAKE_TIMEOUT_S = 10.0  # pairing, and a request's bytes once it started arriving
CHALLENGE_TIMEOUT_S = 2.0  # a new connection's answer to the challenge (or, keyless, its hello)
MAX_PENDING = 64  # connections of one receiver awaiting that answer; more are closed at once
MAX_PEERS = 64  # authenticated connections one receiver serves at a time
CLOSE_TIMEOUT_S = 10.0


class _RefusedByPeer(TransferError):
    """The receiver answered and said no; the connection (ucx) or pair (nccl) stays usable."""


class MalformedRequest(TransferError):
    """A request frame the receiver cannot trust; its message is the reply's reason."""


# -- peer authentication (both sides hold the deployment's transfer key) -------------------------
PROOF_BYTES = 32
TAG_BYTES = 32  # a control frame's HMAC-SHA256
PAYLOAD_TAG_BYTES = 16  # a payload's Poly1305
_KEYLESS = b"pdserve-v1/keyless-transfer"  # public: without a key, tags only catch corruption


class PeerNotAuthenticated(TransferError):
    """The other end of a control connection did not prove it holds the transfer key."""


class TamperedFrame(TransferError):
    """A control frame failed its tag: altered, replayed, reordered, or not from the peer."""


def _proof(key: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, label + first + second, hashlib.sha256).digest()


def _flat_bytes(payload: object) -> memoryview:
    """A payload (tensor on any device, or a buffer) as flat host bytes, for its tag. A CUDA
    tensor is copied to the host for this (a host transport sending a GPU payload: the
    device-direct nccl path tags its digest instead)."""
    if hasattr(payload, "element_size"):
        import torch

        tensor = payload.detach()
        if tensor.is_cuda:
            tensor = tensor.cpu()
        return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
    if hasattr(payload, "__cuda_array_interface__"):
        import numpy

        return memoryview(numpy.asarray(payload.get() if hasattr(payload, "get") else payload)).cast("B")
    view = memoryview(payload)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class Session:
    """One control connection's MAC state: the session key and each direction's frame count.
    Built by the authentication below (one per connection, never shared between threads)."""

    def __init__(self, key: bytes, is_sender: bool) -> None:
        self._key = key
        self.is_keyed = key != _KEYLESS  # keyless, a payload's tag would only repeat its checksum
        self._out, self._in = (b"s2r", b"r2s") if is_sender else (b"r2s", b"s2r")
        self._num_sent = self._num_received = 0

    @classmethod
    def derive(cls, transfer_key: bytes | None, challenge: bytes, nonce: bytes,
               is_sender: bool) -> "Session":
        if transfer_key is None:
            return cls(_KEYLESS, is_sender)
        return cls(_proof(transfer_key, b"session", challenge, nonce), is_sender)

    def _tag(self, label: bytes, number: int, frame: bytes) -> bytes:
        return hmac.new(self._key, label + struct.pack("<Q", number) + frame, hashlib.sha256).digest()

    def seal(self, frame: bytes) -> bytes:
        """`frame` followed by its tag (the next frame number in our direction)."""
        tag = self._tag(self._out, self._num_sent, frame)
        self._num_sent += 1
        return frame + tag

    def open(self, frame: bytes, tag: bytes) -> bytes:
        """`frame` if `tag` is the peer's next tag on it; TamperedFrame otherwise."""
        if not hmac.compare_digest(tag, self._tag(self._in, self._num_received, frame)):
            raise TamperedFrame("a control frame failed its MAC (altered in transit, or not "
                                "from the authenticated peer)")
        self._num_received += 1
        return frame

    def _payload_mac(self, seq: int, header: bytes, index: bytes, payload: object, on_device: bool):
        """Poly1305 over the payload under a one-time key, HMAC-SHA256(session key, "payload"
        seq header index): the header carries the transfer id and the payload's checksum, so
        no key is used for two payloads. (Poly1305 runs at ~11 GB/s here, HMAC-SHA256 at 1.7.)

        `on_device` (a GPU tensor, nccl's device-direct path): Poly1305 over the payload's NH
        digest (`kernels.digest`, computed on the GPU) under a second one-time key, so the
        payload never crosses to the host; a forgery must collide the digest (2^-128 per
        level for keys it never sees) or break Poly1305."""
        from cryptography.hazmat.primitives.poly1305 import Poly1305

        context = struct.pack("<Q", seq) + header + index
        mac = Poly1305(hmac.new(self._key, b"payload" + context, hashlib.sha256).digest())
        if not on_device:
            mac.update(_flat_bytes(payload))
            return mac
        from pdserve.kernels import digest

        secret = hmac.new(self._key, b"payload-nh16" + context, hashlib.sha256).digest()
        mac.update(b"nh16")
        mac.update(digest.keyed_digest(payload, secret))
        return mac

    def payload_tag(self, seq: int, header: bytes, index: bytes, payload: object, on_device: bool = False) -> bytes:
        if not self.is_keyed:
            return bytes(PAYLOAD_TAG_BYTES)
        return self._payload_mac(seq, header, index, payload, on_device).finalize()

    def check_payload(self, seq: int, header: bytes, index: bytes, payload: object, tag: bytes,
                      on_device: bool = False) -> None:
        from cryptography.exceptions import InvalidSignature

        if not self.is_keyed:  # the sink still verifies the payload's checksum
            return
        try:
            self._payload_mac(seq, header, index, payload, on_device).verify(tag)
        except InvalidSignature:
            raise TransferError("payload MAC mismatch: the KV bytes were altered in transit") from None


def sender_answer(key: bytes, challenge: bytes) -> tuple[bytes, bytes]:
    """(our nonce, the frame that answers the receiver's challenge)."""
    nonce = os.urandom(PROOF_BYTES)
    return nonce, nonce + _proof(key, b"s2r", challenge, nonce)


def check_sender(key: bytes, challenge: bytes, frame: bytes) -> tuple[bytes, Session]:
    """(the receiver's proof, the session) for a sender whose answer `frame` holds;
    PeerNotAuthenticated else."""
    nonce, proof = frame[:PROOF_BYTES], frame[PROOF_BYTES:]
    if not hmac.compare_digest(proof, _proof(key, b"s2r", challenge, nonce)):
        raise PeerNotAuthenticated("the sender did not prove it belongs to this deployment")
    return _proof(key, b"r2s", nonce, challenge), Session.derive(key, challenge, nonce, False)


def check_receiver(key: bytes, challenge: bytes, nonce: bytes, proof: bytes, endpoint: str) -> Session:
    if not hmac.compare_digest(proof, _proof(key, b"r2s", nonce, challenge)):
        raise PeerNotAuthenticated(f"{endpoint} did not prove it belongs to this deployment")
    return Session.derive(key, challenge, nonce, True)


async def authenticate_receiver_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                       key: bytes | None, endpoint: str) -> Session:
    """Sender side, asyncio streams (callers bound it with a deadline). No key: no challenge."""
    if key is None:
        return Session.derive(None, b"", b"", True)
    challenge = await reader.readexactly(PROOF_BYTES)
    nonce, answer = sender_answer(key, challenge)
    writer.write(answer)
    await writer.drain()
    return check_receiver(key, challenge, nonce, await reader.readexactly(PROOF_BYTES), endpoint)


async def authenticate_sender_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                     key: bytes | None) -> Session:
    """Receiver side, asyncio streams. No key: no challenge."""
    if key is None:
        return Session.derive(None, b"", b"", False)
    challenge = os.urandom(PROOF_BYTES)
    writer.write(challenge)
    await writer.drain()
    proof, session = check_sender(key, challenge, await reader.readexactly(2 * PROOF_BYTES))
    writer.write(proof)
    await writer.drain()
    return session


def authenticate_receiver(sock: socket.socket, key: bytes | None, endpoint: str, deadline: float) -> Session:
    """Sender side, a blocking socket. No key: no challenge."""
    if key is None:
        return Session.derive(None, b"", b"", True)
    challenge = recv_exactly(sock, PROOF_BYTES, deadline)
    nonce, answer = sender_answer(key, challenge)
    send_all(sock, answer, deadline)
    return check_receiver(key, challenge, nonce, recv_exactly(sock, PROOF_BYTES, deadline), endpoint)


def recv_sealed(sock: socket.socket, session: Session, n: int, deadline: float) -> bytes:
    """A fixed-size frame and its tag, checked (blocking socket)."""
    frame = recv_exactly(sock, n + TAG_BYTES, deadline)
    return session.open(frame[:n], frame[n:])


async def read_sealed(reader: asyncio.StreamReader, session: Session, n: int) -> bytes:
    """A fixed-size frame and its tag, checked (asyncio stream)."""
    frame = await reader.readexactly(n + TAG_BYTES)
    return session.open(frame[:n], frame[n:])


# -- control sockets -----------------------------------------------------------------------------
def keep_alive(sock) -> None:
    """Have the kernel probe `sock` once idle: a connection whose peer vanished (a partition
    sends no reset) fails within about KEEPIDLE + KEEPINTVL * KEEPCNT seconds instead of holding
    a receiver's peer slot, or a sender's link, forever. A frozen peer's kernel still answers."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # Linux; elsewhere the system's keepalive timing applies
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


# -- endpoints and messages ----------------------------------------------------------------------
def split_endpoint(endpoint: str, transport: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TransferError(f"bad {transport} endpoint {endpoint!r}: expected host:port")
    return host, int(port)


def format_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_payload_len(message: BlockMessage) -> None:
    """The payload must be as long as our own header says (the sender trusts its own header)."""
    if len(message.header) != HEADER_SIZE:
        raise TransferError(f"header is {len(message.header)} bytes, not {HEADER_SIZE}")
    declared = declared_payload_len(message.header)
    if message.payload_nbytes != declared:
        raise TransferError(f"payload is {message.payload_nbytes} bytes, its header says {declared}")


# -- frames --------------------------------------------------------------------------------------
def encode_request(session: Session, seq: int, message: BlockMessage, deadline: float,
                   payload: object = None, on_device: bool = False) -> bytes:
    """The sealed request for `message`, its payload's tag included (over `payload` when
    given: the same bytes where the transport sends them from, e.g. a GPU tensor)."""
    budget_ms = int(min(MAX_BUDGET_MS, max(1.0, (deadline - time.monotonic()) * 1000)))
    head = REQUEST.pack(REQUEST_MAGIC, seq, budget_ms, len(message.index))
    payload_tag = session.payload_tag(seq, message.header, message.index,
                                      message.payload if payload is None else payload, on_device)
    return session.seal(head + message.header + message.index + payload_tag)


def parse_request(frame: bytes, limits: WireLimits,
                  max_seq: int = 0xFFFFFFFF) -> tuple[int, float, int]:
    """(seq, budget in seconds, index length) of a REQUEST prefix, or MalformedRequest. The
    prefix is only bounds-checked here; its tag comes with the rest (`request_rest_len`)."""
    magic, seq, budget_ms, index_len = REQUEST.unpack(frame)
    max_index = limits.max_blocks * INDEX_ENTRY_SIZE
    if magic != REQUEST_MAGIC or index_len > max_index or seq > max_seq:
        raise MalformedRequest(f"malformed request (index of {index_len} bytes, at most {max_index})")
    return seq, min(MAX_BUDGET_MS, max(1, budget_ms)) / 1000, index_len


def encode_ping(session: Session, seq: int, deadline: float) -> bytes:
    """The sealed probe `seq`; its budget bounds the receiver's wait for the probe's bytes."""
    budget_ms = int(min(MAX_BUDGET_MS, max(1.0, (deadline - time.monotonic()) * 1000)))
    return session.seal(REQUEST.pack(PING_MAGIC, seq, budget_ms, 0))


def is_ping(prefix: bytes) -> bool:
    return prefix[:len(PING_MAGIC)] == PING_MAGIC


def open_ping(session: Session, prefix: bytes, tag: bytes, max_seq: int = 0xFFFFFFFF) -> tuple[int, float]:
    """(seq, budget in seconds) of a probe whose tag checks; MalformedRequest or TamperedFrame else."""
    magic, seq, budget_ms, index_len = REQUEST.unpack(session.open(prefix, tag))
    if magic != PING_MAGIC or index_len or seq > max_seq:
        raise MalformedRequest("malformed probe")
    return seq, min(MAX_BUDGET_MS, max(1, budget_ms)) / 1000


def probe_deadline(deadline: float) -> float:
    """When a probe before a request due by `deadline` must have been answered."""
    return min(deadline, time.monotonic() + PROBE_TIMEOUT_S)


def request_rest_len(index_len: int) -> int:
    """Bytes that follow a REQUEST prefix: header, index, payload tag, the frame's tag."""
    return HEADER_SIZE + index_len + PAYLOAD_TAG_BYTES + TAG_BYTES


def open_request(session: Session, prefix: bytes, rest: bytes) -> tuple[bytes, bytes]:
    """(header + index body, payload tag) of a request whose tag checks; TamperedFrame else."""
    frame = session.open(prefix + rest[:-TAG_BYTES], rest[-TAG_BYTES:])
    return frame[REQUEST.size:-PAYLOAD_TAG_BYTES], frame[-PAYLOAD_TAG_BYTES:]


def parse_body(body: bytes, index_len: int, limits: WireLimits) -> tuple[BlockHeader, bytes]:
    """The wire header (checked against `limits`) and the index section of a request body."""
    header = parse_header(body[:HEADER_SIZE], limits)
    if header.index_len != index_len:
        raise TransferError(f"index is {index_len} bytes, the header implies {header.index_len}")
    return header, body[HEADER_SIZE:]


def reply(session: Session, ok: bool, reason: str = "") -> bytes:
    text = reason.encode("utf-8", "replace")[:MAX_REASON]
    return session.seal(REPLY.pack(1 if ok else 0, 0, len(text)) + text)


def refusal(session: Session, exc: Exception) -> bytes:
    return reply(session, False, str(exc) or exc.__class__.__name__)


def _reply_head(frame: bytes, transport: str) -> tuple[bool, int]:
    ok, reserved, length = REPLY.unpack(frame)
    if ok not in (0, 1) or reserved or length > MAX_REASON:
        raise TransferError(f"malformed reply from the {transport} peer")
    return ok == 1, length


def raise_if_refused(answer: tuple[bool, str], endpoint: str) -> None:
    ok, reason = answer
    if not ok:
        raise _RefusedByPeer(f"refused by {endpoint}: {reason}")


async def read_reply_stream(reader: asyncio.StreamReader, session: Session,
                            transport: str) -> tuple[bool, str]:
    head = await reader.readexactly(REPLY.size)
    ok, length = _reply_head(head, transport)
    rest = await reader.readexactly(length + TAG_BYTES)
    session.open(head + rest[:length], rest[length:])
    return ok, rest[:length].decode("utf-8", "replace")


def read_reply(sock: socket.socket, session: Session, deadline: float, transport: str) -> tuple[bool, str]:
    head = recv_exactly(sock, REPLY.size, deadline)
    ok, length = _reply_head(head, transport)
    rest = recv_exactly(sock, length + TAG_BYTES, deadline)
    session.open(head + rest[:length], rest[length:])
    return ok, rest[:length].decode("utf-8", "replace")


# -- blocking sockets with deadlines -------------------------------------------------------------
def recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
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


def send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("deadline passed before sending")
    sock.settimeout(remaining)
    try:
        sock.sendall(data)
    except socket.timeout:
        raise TimeoutError("peer did not take our bytes before the deadline") from None

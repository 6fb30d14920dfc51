"""The frames of the link protocol (`_link`) and blocking socket I/O with deadlines.

Every frame below travels on a link's TCP control connection, sealed with the session's tag
(`security.transfer_session`), after the challenge and the hellos; all integers little-endian::

    S -> R  hello    HELLO (20 B): magic b"PDHI", VERSION, transport name (8 B, NUL padded),
                     its version, body length; + the transport's hello (<= MAX_HELLO)
    R -> S  reply    accept, or refuse + reason; after an accept, BODY (4 B) + the transport's
                     welcome (<= MAX_HELLO): both sides then open the payload channel
    S -> R  request  REQUEST (16 B): magic b"PDRQ", seq, budget ms, index length
                     + wire header (72 B) + index (16 B per block)
    R -> S  reply    REPLY (4 B): ok, reserved 0, reason length; + reason (UTF-8, <= 1 KiB)
    S -> R  payload  on the payload channel, only after an accepting reply: keyed, the
                     payload sealed in chunks (each its ciphertext, then its 16 B tag), chunk
                     k under seq + k (`_payload`); keyless, in clear under seq
    R -> S  reply    the verdict: ok, or refused + reason
    S -> R  ping     REQUEST (16 B) with magic b"PDPG", index length 0: a probe, answered like a
                     request whose payload is PROBE_BYTES

The budget (capped at MAX_BUDGET_MS) bounds how long R waits for the payload. A refusal
before the payload keeps the stream in sync; a malformed request cannot be resynchronised, so
R answers it and drops the connection.
"""
from __future__ import annotations

import socket
import struct
import time

from pdserve.common.errors import TransferError
from pdserve.kvtransfer.base import BlockMessage
from pdserve.kvtransfer.wire import (
    HEADER_SIZE, INDEX_ENTRY_SIZE, BlockHeader, WireLimits, declared_payload_len, parse_header,
)
from pdserve.security.transfer_session import (  # noqa: F401  (the session's names, re-exported)
    PAYLOAD_TAG_BYTES, PROOF_BYTES, TAG_BYTES, PeerNotAuthenticated, Session, TamperedFrame,
    TamperedPayload, check_receiver, check_sender, sender_answer,
)

HELLO = struct.Struct("<4sH8sHI")  # magic, VERSION, transport name, its version, body length
BODY = struct.Struct("<I")  # length of the welcome's body
HELLO_MAGIC = b"PDHI"
MAX_HELLO = 1 << 16  # a UCX worker address is a few hundred bytes; refuse absurd ones

REQUEST = struct.Struct("<4sIII")  # magic, seq, budget ms, index length
REPLY = struct.Struct("<BBH")  # ok, reserved (0), reason length; then the reason (UTF-8)
REQUEST_MAGIC, VERSION = b"PDRQ", 6  # these frames' version, carried by the hello (6: chunked payloads)
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
    """The receiver answered and said no. The link stays, unless the receiver then hung up (a
    request it could not trust): the next send finds out and connects afresh."""


class MalformedRequest(TransferError):
    """A request frame the receiver cannot trust; its message is the reply's reason."""


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
def encode_request(session: Session, seq: int, message: BlockMessage, deadline: float) -> bytes:
    """The sealed request for `message` (a keyed link's payload cipher is taken right before:
    `Session.payload_sealer`)."""
    budget_ms = int(min(MAX_BUDGET_MS, max(1.0, (deadline - time.monotonic()) * 1000)))
    head = REQUEST.pack(REQUEST_MAGIC, seq, budget_ms, len(message.index))
    return session.seal(head + message.header + message.index)


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
    """Bytes that follow a REQUEST prefix: header, index, the frame's tag."""
    return HEADER_SIZE + index_len + TAG_BYTES


def open_request(session: Session, prefix: bytes, rest: bytes) -> bytes:
    """The header + index body of a request whose tag checks; TamperedFrame else."""
    return session.open(prefix + rest[:-TAG_BYTES], rest[-TAG_BYTES:])[REQUEST.size:]


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


def recv_sealed(sock: socket.socket, session: Session, n: int, deadline: float) -> bytes:
    """A fixed-size frame and its tag, checked."""
    frame = recv_exactly(sock, n + TAG_BYTES, deadline)
    return session.open(frame[:n], frame[n:])


def authenticate_receiver(sock: socket.socket, key: bytes | None, endpoint: str, deadline: float) -> Session:
    """Sender side: answer the receiver's challenge, check its proof. No key: no challenge."""
    if key is None:
        return Session.derive(None, b"", b"", True)
    challenge = recv_exactly(sock, PROOF_BYTES, deadline)
    nonce, answer = sender_answer(key, challenge)
    send_all(sock, answer, deadline)
    return check_receiver(key, challenge, nonce, recv_exactly(sock, PROOF_BYTES, deadline), endpoint)


# -- hellos --------------------------------------------------------------------------------------
def encode_hello(session: Session, transport: str, version: int, body: bytes) -> bytes:
    return session.seal(HELLO.pack(HELLO_MAGIC, VERSION, transport.encode(), version, len(body)) + body)


def read_hello(sock: socket.socket, session: Session, transport: str, version: int,
               deadline: float) -> bytes:
    """The body of the sender's hello; TransferError when it speaks another transport or version
    (the stream is then out of step: the caller drops the connection after saying why)."""
    head = recv_exactly(sock, HELLO.size, deadline)
    magic, ours, name, theirs, length = HELLO.unpack(head)
    if magic != HELLO_MAGIC or length > MAX_HELLO:
        raise MalformedRequest(f"not a pdserve {transport} sender")
    rest = recv_exactly(sock, length + TAG_BYTES, deadline)
    body = session.open(head + rest[:length], rest[length:])[HELLO.size:]
    if ours != VERSION or name.rstrip(b"\0") != transport.encode() or theirs != version:
        raise TransferError(f"not a pdserve {transport} sender of version {version} on link "
                            f"protocol {VERSION} (it speaks "
                            f"{name.rstrip(bytes(1)).decode('ascii', 'replace')} {theirs} on {ours})")
    return body


def encode_welcome(session: Session, body: bytes) -> bytes:
    return reply(session, True) + session.seal(BODY.pack(len(body)) + body)


def read_welcome(sock: socket.socket, session: Session, endpoint: str, transport: str,
                 deadline: float) -> bytes:
    ok, reason = read_reply(sock, session, deadline, transport)
    if not ok:
        raise TransferError(f"{endpoint} refused the {transport} link: {reason}")
    (length,) = BODY.unpack(recv_exactly(sock, BODY.size, deadline))
    if length > MAX_HELLO:
        raise TransferError(f"{endpoint} is not a pdserve {transport} receiver")
    rest = recv_exactly(sock, length + TAG_BYTES, deadline)
    return session.open(BODY.pack(length) + rest[:length], rest[length:])[BODY.size:]

"""The control protocol shared by the point-to-point transports (`ucx`, `nccl`).

Each transport carries payload bytes on its own channel (UCX, a process group) and everything
else on one TCP control connection from sender S to receiver R. With a transfer key (from the
cluster secret) each connection starts with a mutual challenge-response, before the
transport's hello and before either side reads anything else::

    R -> S  challenge c (32 random bytes)
    S -> R  nonce n (32 random bytes) + HMAC-SHA256(key, "s2r" c n)
    R -> S  HMAC-SHA256(key, "r2s" n c)       (R closes the connection if S's proof fails)

After the transport's own hello, every message on a connection is (all integers
little-endian)::

    S -> R  request  REQUEST (16 B): magic b"PDRQ", seq, budget ms, index length
                     + wire header (72 B) + index (16 B per block)
    R -> S  reply    REPLY (4 B): ok, reserved 0, reason length; + reason (UTF-8, <= 1 KiB)
    S -> R  payload  on the transport's channel, only after an accepting reply
    R -> S  reply    the verdict: ok, or refused + reason

The budget (capped at MAX_BUDGET_MS) bounds how long R waits for the payload. A refusal
before the payload keeps the stream in sync; a malformed request cannot be resynchronised, so
R answers it and drops the connection. Reads come in two kinds: blocking sockets with a
deadline (nccl) and asyncio streams (ucx, whose callers bound them with `wait_for`).
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
REQUEST_MAGIC, VERSION = b"PDRQ", 1  # VERSION also goes in each transport's hello
MAX_REASON = 1024
MAX_BUDGET_MS = 600_000  # a receiver waits at most this long for one payload
HANDSHAKE_TIMEOUT_S = 10.0  # pairing, and a request's bytes once it started arriving
CLOSE_TIMEOUT_S = 10.0


class _RefusedByPeer(TransferError):
    """The receiver answered and said no; the connection (ucx) or pair (nccl) stays usable."""


class MalformedRequest(TransferError):
    """A request frame the receiver cannot trust; its message is the reply's reason."""


# -- peer authentication (both sides hold the deployment's transfer key) -------------------------
PROOF_BYTES = 32


class PeerNotAuthenticated(TransferError):
    """The other end of a control connection did not prove it holds the transfer key."""


def _proof(key: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, label + first + second, hashlib.sha256).digest()


def sender_answer(key: bytes, challenge: bytes) -> tuple[bytes, bytes]:
    """(our nonce, the frame that answers the receiver's challenge)."""
    nonce = os.urandom(PROOF_BYTES)
    return nonce, nonce + _proof(key, b"s2r", challenge, nonce)


def check_sender(key: bytes, challenge: bytes, frame: bytes) -> bytes:
    """The receiver's proof for a sender whose answer `frame` holds; PeerNotAuthenticated else."""
    nonce, proof = frame[:PROOF_BYTES], frame[PROOF_BYTES:]
    if not hmac.compare_digest(proof, _proof(key, b"s2r", challenge, nonce)):
        raise PeerNotAuthenticated("the sender did not prove it belongs to this deployment")
    return _proof(key, b"r2s", nonce, challenge)


def check_receiver(key: bytes, challenge: bytes, nonce: bytes, proof: bytes, endpoint: str) -> None:
    if not hmac.compare_digest(proof, _proof(key, b"r2s", nonce, challenge)):
        raise PeerNotAuthenticated(f"{endpoint} did not prove it belongs to this deployment")


async def authenticate_receiver_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                       key: bytes | None, endpoint: str) -> None:
    """Sender side, asyncio streams (callers bound it with a deadline). No key: nothing."""
    if key is None:
        return
    challenge = await reader.readexactly(PROOF_BYTES)
    nonce, answer = sender_answer(key, challenge)
    writer.write(answer)
    await writer.drain()
    check_receiver(key, challenge, nonce, await reader.readexactly(PROOF_BYTES), endpoint)


async def authenticate_sender_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                     key: bytes | None) -> None:
    """Receiver side, asyncio streams. No key: nothing."""
    if key is None:
        return
    challenge = os.urandom(PROOF_BYTES)
    writer.write(challenge)
    await writer.drain()
    writer.write(check_sender(key, challenge, await reader.readexactly(2 * PROOF_BYTES)))
    await writer.drain()


def authenticate_receiver(sock: socket.socket, key: bytes | None, endpoint: str, deadline: float) -> None:
    """Sender side, a blocking socket. No key: nothing."""
    if key is None:
        return
    challenge = recv_exactly(sock, PROOF_BYTES, deadline)
    nonce, answer = sender_answer(key, challenge)
    send_all(sock, answer, deadline)
    check_receiver(key, challenge, nonce, recv_exactly(sock, PROOF_BYTES, deadline), endpoint)


def authenticate_sender(sock: socket.socket, key: bytes | None, deadline: float) -> None:
    """Receiver side, a blocking socket. No key: nothing."""
    if key is None:
        return
    challenge = os.urandom(PROOF_BYTES)
    send_all(sock, challenge, deadline)
    send_all(sock, check_sender(key, challenge, recv_exactly(sock, 2 * PROOF_BYTES, deadline)), deadline)


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
def encode_request(seq: int, message: BlockMessage, deadline: float) -> bytes:
    budget_ms = int(min(MAX_BUDGET_MS, max(1.0, (deadline - time.monotonic()) * 1000)))
    head = REQUEST.pack(REQUEST_MAGIC, seq, budget_ms, len(message.index))
    return head + message.header + message.index


def parse_request(frame: bytes, limits: WireLimits,
                  max_seq: int = 0xFFFFFFFF) -> tuple[int, float, int]:
    """(seq, budget in seconds, index length) of a REQUEST frame, or MalformedRequest."""
    magic, seq, budget_ms, index_len = REQUEST.unpack(frame)
    max_index = limits.max_blocks * INDEX_ENTRY_SIZE
    if magic != REQUEST_MAGIC or index_len > max_index or seq > max_seq:
        raise MalformedRequest(f"malformed request (index of {index_len} bytes, at most {max_index})")
    return seq, min(MAX_BUDGET_MS, max(1, budget_ms)) / 1000, index_len


def parse_body(body: bytes, index_len: int, limits: WireLimits) -> tuple[BlockHeader, bytes]:
    """The wire header (checked against `limits`) and the index section of a request body."""
    header = parse_header(body[:HEADER_SIZE], limits)
    if header.index_len != index_len:
        raise TransferError(f"index is {index_len} bytes, the header implies {header.index_len}")
    return header, body[HEADER_SIZE:]


def reply(ok: bool, reason: str = "") -> bytes:
    text = reason.encode("utf-8", "replace")[:MAX_REASON]
    return REPLY.pack(1 if ok else 0, 0, len(text)) + text


def refusal(exc: Exception) -> bytes:
    return reply(False, str(exc) or exc.__class__.__name__)


def _reply_head(frame: bytes, transport: str) -> tuple[bool, int]:
    ok, reserved, length = REPLY.unpack(frame)
    if ok not in (0, 1) or reserved or length > MAX_REASON:
        raise TransferError(f"malformed reply from the {transport} peer")
    return ok == 1, length


def raise_if_refused(answer: tuple[bool, str], endpoint: str) -> None:
    ok, reason = answer
    if not ok:
        raise _RefusedByPeer(f"refused by {endpoint}: {reason}")


async def read_reply_stream(reader: asyncio.StreamReader, transport: str) -> tuple[bool, str]:
    ok, length = _reply_head(await reader.readexactly(REPLY.size), transport)
    return ok, (await reader.readexactly(length)).decode("utf-8", "replace")


def read_reply(sock: socket.socket, deadline: float, transport: str) -> tuple[bool, str]:
    ok, length = _reply_head(recv_exactly(sock, REPLY.size, deadline), transport)
    return ok, recv_exactly(sock, length, deadline).decode("utf-8", "replace")


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

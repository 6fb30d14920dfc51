"""The transfer session: who may speak on a KV transfer link, and whether what arrived was sent.

Threat: anyone who can reach a transfer port (or sits on the path between prefill and decode)
would otherwise write KV into a decode's cache, read which blocks a prompt lands in, or alter,
drop, replay or reorder the control frames of a live link (turning a receiver's refusal into
an "ok" the sender believes, or a request for blocks 20..21 into one for 21..22).

Rule: a link starts with a mutual challenge-response over the deployment's transfer key, and
from then on every control frame in either direction carries a tag bound to the session, its
direction and its position; every payload carries a one-time MAC that its receiver checks on
the bytes that arrived before anything sees them. A frame or payload that fails its tag ends
the exchange. Keyless (`--insecure-internal`) the tags use a public key: they catch corruption,
not an attacker, and payloads carry an all-zero tag (the sink checks their checksum)::

    R -> S  challenge c (32 random bytes)
    S -> R  nonce n (32 random bytes) + HMAC-SHA256(key, "s2r" c n)
    R -> S  HMAC-SHA256(key, "r2s" n c)       (R closes the connection if S's proof fails)

Both sides then hold the session key HMAC-SHA256(key, "session" c n), fresh per connection. A
frame's tag is HMAC-SHA256(session key, direction, frame number, frame). A payload's tag is
Poly1305 over the payload under HMAC-SHA256(session key, "payload" seq header index) (the
header names the transfer and holds its checksum, so no one-time key serves two payloads);
for a payload that stays on a GPU, Poly1305 over its keyed NH digest instead, the digest's
key a second one-time key (the caller computes the digest where the payload lives).

Torch-free and grpc-free: payloads reach this module as host bytes or as a digest function.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import Callable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.poly1305 import Poly1305

from pdserve.common.errors import TransferError

PROOF_BYTES = 32
TAG_BYTES = 32  # a control frame's HMAC-SHA256
PAYLOAD_TAG_BYTES = 16  # a payload's Poly1305
_KEYLESS = b"pdserve-v1/keyless-transfer"  # public: without a key, tags only catch corruption

HostBytes = Callable[[], memoryview]  # the payload as flat host bytes, computed only when needed
DeviceDigest = Callable[[bytes], bytes]  # secret -> the payload's keyed digest, computed on its device


class PeerNotAuthenticated(TransferError):
    """The other end of a control connection did not prove it holds the transfer key."""


class TamperedFrame(TransferError):
    """A control frame failed its tag: altered, replayed, reordered, or not from the peer."""


def _proof(key: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, label + first + second, hashlib.sha256).digest()


class Session:
    """One control connection's MAC state: the session key and each direction's frame count.
    Built by the authentication below (one per connection, never shared between threads)."""

    def __init__(self, key: bytes, is_sender: bool) -> None:
        self._key = key
        self.is_keyed = key != _KEYLESS  # keyless, a payload's tag would only repeat its checksum
        self.is_sender = is_sender
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

    def _payload_mac(self, seq: int, header: bytes, index: bytes, host_bytes: HostBytes,
                     device_digest: DeviceDigest | None) -> Poly1305:
        context = struct.pack("<Q", seq) + header + index
        mac = Poly1305(hmac.new(self._key, b"payload" + context, hashlib.sha256).digest())
        if device_digest is None:
            mac.update(host_bytes())
            return mac
        secret = hmac.new(self._key, b"payload-nh16" + context, hashlib.sha256).digest()
        mac.update(b"nh16")
        mac.update(device_digest(secret))
        return mac

    def payload_tag(self, seq: int, header: bytes, index: bytes, host_bytes: HostBytes,
                    device_digest: DeviceDigest | None = None) -> bytes:
        """The tag of request `seq`'s payload (over `device_digest` when given, else the bytes)."""
        if not self.is_keyed:
            return bytes(PAYLOAD_TAG_BYTES)
        return self._payload_mac(seq, header, index, host_bytes, device_digest).finalize()

    def check_payload(self, seq: int, header: bytes, index: bytes, tag: bytes, host_bytes: HostBytes,
                      device_digest: DeviceDigest | None = None) -> None:
        """TransferError unless `tag` is the sender's tag of the payload that arrived."""
        if not self.is_keyed:  # the sink still verifies the payload's checksum
            return
        try:
            self._payload_mac(seq, header, index, host_bytes, device_digest).verify(tag)
        except InvalidSignature:
            raise TransferError("payload MAC mismatch: the KV bytes were altered in transit") from None


def keyless_session(is_sender: bool) -> Session:
    return Session.derive(None, b"", b"", is_sender)


def new_challenge() -> bytes:
    return os.urandom(PROOF_BYTES)


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
    """The sender's session once the receiver's `proof` checks; PeerNotAuthenticated else."""
    if not hmac.compare_digest(proof, _proof(key, b"r2s", nonce, challenge)):
        raise PeerNotAuthenticated(f"{endpoint} did not prove it belongs to this deployment")
    return Session.derive(key, challenge, nonce, True)

"""The transfer session: who may speak on a KV transfer link, and whether what arrived was sent.

Threat: anyone who can reach a transfer port (or sits on the path between prefill and decode)
would otherwise write KV into a decode's cache, read which blocks a prompt lands in, or alter,
drop, replay or reorder the control frames of a live link (turning a receiver's refusal into
an "ok" the sender believes, or a request for blocks 20..21 into one for 21..22).

Rule: a link starts with a mutual challenge-response over the deployment's transfer key, and
from then on every control frame in either direction carries a tag bound to the session, its
direction and its position; every payload is encrypted and tagged (AEAD) under a key of the
link's own, and its receiver opens it before anything sees a byte of it. A frame that fails
its tag ends the link; a payload that fails its tag is refused, and nothing of it lands.
Keyless (`--insecure-internal`) the tags use a public key: they catch corruption, not an
attacker, and payloads travel in clear, in one piece (the sink checks their checksum)::

    R -> S  challenge c (32 random bytes)
    S -> R  nonce n (32 random bytes) + HMAC-SHA256(key, "s2r" c n)
    R -> S  HMAC-SHA256(key, "r2s" n c)       (R closes the connection if S's proof fails)

Both sides then hold the session key HMAC-SHA256(key, "session" c n), fresh per connection. A
frame's tag is HMAC-SHA256(session key, direction, frame number, frame). A payload is sealed
with AES-GCM (AES-NI makes it the faster AEAD on the CPUs that serve) under
HKDF-SHA256(session key, "payload s2r"), in chunks of PAYLOAD_CHUNK_BYTES (the last one
shorter) so that sealing, moving and opening overlap; each chunk travels as its ciphertext
then its own tag. Chunk i's nonce is (i, the frame number of the request that announces the
payload): a request is a frame, frame numbers only grow, and the key is the link's own, so no
nonce serves twice under one key. Its associated data is the request's seq, header and index,
i and the number of chunks. A chunk altered, moved to another place or another request, or
replayed from an earlier one fails its tag; a chunk missing or cut never completes its receive
(the receiver counts the chunks from the header and waits for each by the deadline). Either
way the receiver refuses the payload before the sink sees anything.

Torch-free and grpc-free: payloads reach this module as host buffers.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from pdserve.common.errors import TransferError

PROOF_BYTES = 32
TAG_BYTES = 32  # a control frame's HMAC-SHA256
PAYLOAD_TAG_BYTES = 16  # a payload chunk's AES-GCM tag
PAYLOAD_CHUNK_BYTES = 8 << 20  # plaintext per sealed chunk: part of the wire format
_KEYLESS = b"pdserve-v1/keyless-transfer"  # public: without a key, tags only catch corruption
_PAYLOAD_KEY_INFO = b"pdserve-v1/transfer-payload-aead s2r"  # payloads go sender -> receiver only


class PeerNotAuthenticated(TransferError):
    """The other end of a control connection did not prove it holds the transfer key."""


class TamperedFrame(TransferError):
    """A control frame failed its tag: altered, replayed, reordered, or not from the peer."""


class TamperedPayload(TransferError):
    """A payload failed its AEAD tag: altered, cut, replayed, or not from the peer."""


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
        self._aead: AESGCM | None = None

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

    def _payload_aead(self) -> AESGCM:
        if self._aead is None:
            self._aead = AESGCM(HKDF(hashes.SHA256(), 32, salt=None,
                                     info=_PAYLOAD_KEY_INFO).derive(self._key))
        return self._aead

    def payload_sealer(self, seq: int, header: bytes, index: bytes, payload_len: int,
                       chunk_bytes: int | None = None) -> "PayloadCipher":
        """Sender: the cipher of the payload announced by the request frame we seal next (call
        it right before sealing that request). Keyed sessions only."""
        if not self.is_keyed:
            raise TransferError("a payload is sealed on a keyed link only")
        return PayloadCipher(self._payload_aead(), self._num_sent, seq, header, index, payload_len, chunk_bytes)

    def payload_opener(self, seq: int, header: bytes, index: bytes, payload_len: int,
                       chunk_bytes: int | None = None) -> "PayloadCipher":
        """Receiver: the cipher of the payload announced by the request frame we opened last."""
        if not self.is_keyed or not self._num_received:
            raise TamperedPayload("a payload is opened on a keyed link, after its request")
        return PayloadCipher(self._payload_aead(), self._num_received - 1, seq, header, index,
                             payload_len, chunk_bytes)


def num_payload_chunks(payload_len: int, chunk_bytes: int | None = None) -> int:
    """How many chunks a payload of `payload_len` bytes is sealed in (an empty one: one);
    `chunk_bytes`: plaintext per chunk (None: PAYLOAD_CHUNK_BYTES)."""
    return max(1, -(-payload_len // (chunk_bytes or PAYLOAD_CHUNK_BYTES)))


def payload_chunks(payload_len: int, chunk_bytes: int | None = None) -> list[tuple[slice, slice]]:
    """(plaintext bytes, sealed bytes) of each chunk of a payload of `payload_len`: chunk k is
    plaintext [k * C, min(len, (k + 1) * C)) and sealed [k * (C + T), + its length + T), where
    C = `chunk_bytes` (None: PAYLOAD_CHUNK_BYTES) and T = PAYLOAD_TAG_BYTES (its ciphertext,
    then its tag)."""
    size = chunk_bytes or PAYLOAD_CHUNK_BYTES
    spans = []
    for k in range(num_payload_chunks(payload_len, size)):
        start = k * size
        stop = min(payload_len, start + size)
        at = k * (size + PAYLOAD_TAG_BYTES)
        spans.append((slice(start, stop), slice(at, at + stop - start + PAYLOAD_TAG_BYTES)))
    return spans


class PayloadCipher:
    """One payload's chunks (`payload_chunks`) under its request's frame number."""

    def __init__(self, aead: AESGCM, frame_number: int, seq: int, header: bytes, index: bytes,
                 payload_len: int, chunk_bytes: int | None = None) -> None:
        self._aead, self._frame_number = aead, frame_number
        self.payload_len = payload_len
        self.num_chunks = num_payload_chunks(payload_len, chunk_bytes)
        self._context = b"pdserve-payload-chunks" + struct.pack("<QI", seq, self.num_chunks) + header + index

    def _nonce_and_context(self, chunk: int) -> tuple[bytes, bytes]:
        if not 0 <= chunk < self.num_chunks:
            raise TransferError(f"chunk {chunk} of a payload of {self.num_chunks}")
        return struct.pack("<IQ", chunk, self._frame_number), self._context + struct.pack("<I", chunk)

    def seal(self, chunk: int, plaintext: memoryview, out: memoryview) -> None:
        """Encrypt chunk `chunk`'s `plaintext` into `out`: ciphertext, then the tag."""
        if len(out) != len(plaintext) + PAYLOAD_TAG_BYTES:
            raise TransferError("a chunk is sealed into its length plus a tag")
        nonce, context = self._nonce_and_context(chunk)
        self._aead.encrypt_into(nonce, plaintext, context, out)

    def open(self, chunk: int, sealed: memoryview, out: memoryview) -> None:
        """Decrypt chunk `chunk` (`sealed`: ciphertext, then its tag) into `out`. Raises
        TamperedPayload, and then `out` holds nothing to use."""
        if len(sealed) != len(out) + PAYLOAD_TAG_BYTES:
            raise TamperedPayload("a payload chunk is not its announced length plus its tag")
        nonce, context = self._nonce_and_context(chunk)
        try:
            self._aead.decrypt_into(nonce, sealed, context, out)
        except InvalidTag:
            raise TamperedPayload("the payload failed its AEAD tag: altered, replayed or not "
                                  "from the authenticated peer") from None


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

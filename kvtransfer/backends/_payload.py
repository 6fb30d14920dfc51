"""A message's payload on a link's channel: in clear (keyless), or sealed in chunks and pipelined.

Keyless, the payload moves as one piece, straight from the message into the sink's landing.
Keyed, it moves as the chunks of `security.transfer_session` (PAYLOAD_CHUNK_BYTES of plaintext
each, the last shorter; on the channel each is its ciphertext then its tag), chunk k under
channel seq (request seq + k): the sender seals chunk k+1 while the channel moves chunk k, and
the receiver opens chunk k while chunk k+1 arrives. Layout of a sealed payload of n chunks::

    plaintext  [0, C) [C, 2C) ... [(n-1)C, len)                          (C = PAYLOAD_CHUNK_BYTES)
    channel    [ct 0 | tag 0] [ct 1 | tag 1] ... [ct n-1 | tag n-1]    (chunk k at k * (C + 16))

Copies: the sender encrypts from the payload's own memory into its link's send buffer, the
receiver decrypts from its link's landing buffer into the sink's staging: one pass over the
bytes each side beyond what the channel does (a CUDA payload is first copied to the host,
chunk by chunk on the receiver).

Rule, "opened before anything lands": plaintext is written only into the sink's staging, which
is this message's alone, and the sink commits it only after every chunk opened; a chunk that
fails its tag leaves the staging uncommitted (nothing of the payload reaches a cache block).
"""
from __future__ import annotations

import collections

from pdserve.common.errors import TransferError
from pdserve.kvtransfer.backends._channel import Channel
from pdserve.security.transfer_session import PayloadCipher, Session, payload_chunks

SEND_WINDOW = 4  # sealed chunks a sender keeps moving on the channel at once


def chunk_spans(session: Session, payload_len: int, chunk_bytes: int | None = None) -> list[tuple[slice, slice]]:
    """(plaintext bytes, channel bytes) of each piece of a payload of `payload_len` on this link
    (`chunk_bytes`: its channel's `sealed_chunk_bytes`)."""
    if not session.is_keyed:
        return [(slice(0, payload_len), slice(0, payload_len))]
    return payload_chunks(payload_len, chunk_bytes)


def seal_chunk(cipher: PayloadCipher, chunk: int, plaintext: memoryview, out: memoryview) -> None:
    """Seal one chunk into the bytes the channel carries (the seam a test taps the wire at)."""
    cipher.seal(chunk, plaintext, out)


def send_payload(channel: Channel, session: Session, payload: object, cipher: PayloadCipher | None,
                 seq: int, scratch: "Scratch", deadline: float) -> None:
    """Move `payload` to the receive(s) the peer posted under seq, seq + 1, ...: keyless as it is,
    keyed sealed chunk by chunk into `scratch`, at most SEND_WINDOW chunks on the channel at once."""
    if cipher is None:
        channel.send(channel.outgoing(payload), seq, deadline)
        return
    plaintext = flat_bytes(payload)
    spans = chunk_spans(session, len(plaintext), channel.sealed_chunk_bytes)
    sealed = scratch.take(spans[-1][1].stop)
    moving: collections.deque = collections.deque()
    try:
        for k, (plain, wire) in enumerate(spans):
            seal_chunk(cipher, k, plaintext[plain], sealed[wire])
            moving.append(channel.start_send(channel.outgoing(sealed[wire]),
                                             (seq + k) & channel.max_seq, deadline))
            if len(moving) > SEND_WINDOW:
                moving.popleft().wait(deadline)
        while moving:
            moving.popleft().wait(deadline)
    except BaseException:
        for sending in moving:  # the link is dropped; the channel keeps their buffers alive
            sending.abandon()
        raise


class Opening:
    """Receiver: one sealed payload's chunks opened into `staging` as each arrives. After a chunk
    fails, the rest are only received (the stream stays in step) and `check` raises."""

    def __init__(self, session: Session, seq: int, header: bytes, index: bytes, payload_len: int,
                 landing: object, staging: object, chunk_bytes: int | None = None) -> None:
        self.cipher = session.payload_opener(seq, header, index, payload_len, chunk_bytes)
        self.spans = chunk_spans(session, payload_len, chunk_bytes)
        self.landing, self.staging = landing, staging
        self._out: memoryview | None = None
        self._failure: Exception | None = None

    def pieces(self) -> list[object]:
        """Where each chunk lands: the slices of the landing buffer, in order."""
        return [self.landing[wire] for _, wire in self.spans]

    def arrived(self, chunk: int) -> None:
        if self._failure is not None:
            return
        try:
            if self._out is None:
                self._out = writable_host_bytes(self.staging)
            plain, wire = self.spans[chunk]
            self.cipher.open(chunk, flat_bytes(self.landing[wire]), self._out[plain])
        except Exception as exc:  # noqa: BLE001 - refused once every chunk is in (check)
            self._failure = exc

    def check(self) -> None:
        """Raise why the payload was refused (TamperedPayload: a chunk failed its tag)."""
        if self._failure is not None:
            raise self._failure


# -- buffers --------------------------------------------------------------------------------------
def host_buffer(nbytes: int) -> memoryview:
    """`nbytes` of host memory, not zeroed."""
    import numpy

    return memoryview(numpy.empty(nbytes, dtype=numpy.uint8))


class Scratch:
    """One link side's buffer for sealed payloads, grown as needed and reused: a link carries
    one payload at a time, and a link whose payload was abandoned is dropped (the buffer
    goes with it; a channel may keep it alive a while, `ucx._Quarantine`)."""

    def __init__(self, allocate) -> None:
        self._allocate = allocate  # nbytes -> a flat buffer (a channel's `probe_landing`)
        self._buffer = None

    def take(self, nbytes: int):
        """The first `nbytes` of the buffer (a view), reallocated when too small."""
        if self._buffer is None or len(self._buffer) < nbytes:
            self._buffer = None
            self._buffer = self._allocate(nbytes)
        return self._buffer[:nbytes]


def writable_host_bytes(buffer: object) -> memoryview:
    """A staging buffer (host tensor or buffer) as flat writable bytes, sharing its memory."""
    if hasattr(buffer, "element_size"):
        if buffer.is_cuda or not buffer.is_contiguous():
            raise TransferError("a sealed payload is opened into contiguous host memory only")
        import torch

        return memoryview(buffer.detach().reshape(-1).view(torch.uint8).numpy())
    view = memoryview(buffer)
    if view.readonly:
        raise TransferError("the staging buffer is read-only")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def flat_bytes(payload: object) -> memoryview:
    """A payload (tensor on any device, or a buffer) as flat host bytes, to seal or open (a
    CUDA tensor is copied to the host for this), or for a host channel to send."""
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

"""The payload channel contract: all a point-to-point transport adds to the link protocol.

The protocol (`_link`) owns the control connection: the challenge, the hellos, requests,
replies, probes, deadlines, reconnects, and every admission limit. A transport supplies a
`Carrier` (one per transport object) that opens one `Channel` per link once the control
connection has authenticated and exchanged hellos; the channel only moves payload bytes.
It never reads or writes the control connection except where its own `open` says so (nccl
meets its process group through it during `open`; a channel may also carry its bytes on the
control connection itself, as `tcp` does, between an accepting reply and the verdict).

Ordering, per link (the protocol guarantees it; a channel may rely on it):
  * the receiver posts the receive for `seq` (`post_receive`) before it sends the accepting
    reply, and the sender calls `send(.., seq, ..)` only after reading that reply; a keyed
    payload is several pieces under seq, seq + 1, ... (`_payload`): the receiver posts them
    all before the reply and waits for them in order, the sender may have several
    `start_send`s under way at once (each under its own seq, started in seq order);
  * on each side one thread at a time uses a channel (the link's lock, or its serving thread);
  * after `abort` the protocol never uses the channel again; `abort` may be called twice.

Errors: a channel raises TimeoutError for a deadline that passed and TransferError (or
OSError) for a channel that failed; either way the protocol drops the whole link and the
next send opens a fresh one. A `Receive.wait` that returns False (deadline, or the sender hung
up) means the same.
"""
from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

from pdserve.kvtransfer.base import BlockSink
from pdserve.kvtransfer.wire import BlockHeader
from pdserve.security.transfer_session import Session


@dataclass(slots=True)
class Control:
    """A link's authenticated control connection, lent to `Carrier.open` while it opens."""

    sock: socket.socket
    session: Session
    is_sender: bool


@dataclass(slots=True)
class Landing:
    """Where a keyless link's payload lands: `buffer` (what the channel receives into), then
    `finish()` makes the sink's `staging` hold it (a copy when the two differ), and the sink
    commits `staging`. A keyed link's sealed payload lands in a `probe_landing` buffer
    instead and is opened, chunk by chunk, into the sink's host staging by the protocol."""

    staging: object
    buffer: object
    finish: Callable[[], None] = lambda: None


class Receive(ABC):
    """A posted receive."""

    @abstractmethod
    def wait(self, deadline: float, control: socket.socket) -> bool:
        """True once the payload is in the landing buffer. False when `deadline` passed or, where
        the channel can watch it, `control` became readable (the sender sends nothing before
        the verdict, so that is a hang-up). After False the buffer may still be written a while:
        the channel keeps it alive. Raises on a channel error. A deadline already passed
        abandons the receive."""


class Sending(ABC):
    """A send under way (`Channel.start_send`)."""

    @abstractmethod
    def wait(self, deadline: float) -> None:
        """Return once the data moved; raise as `Channel.send` does."""

    def abandon(self) -> None:
        """Give the send up (the link is being dropped): its buffer stays alive while the
        channel may still read it."""


class _Sent(Sending):
    def wait(self, deadline: float) -> None:
        pass


class Channel(ABC):
    """One link's payload channel (see the module docstring for the contract)."""

    max_seq: int = 0xFFFFFFFF  # request numbers wrap past this (a channel's tag space)
    # Plaintext per sealed chunk (None: transfer_session.PAYLOAD_CHUNK_BYTES). Part of the wire
    # format: both ends of a link are channels of one class, so they agree.
    sealed_chunk_bytes: int | None = None

    def outgoing(self, payload: object) -> object:
        """What `send` takes for `payload` (a sealed chunk is a flat host buffer)."""
        return payload

    @abstractmethod
    def send(self, data: object, seq: int, deadline: float) -> None:
        """Move `data` into the peer's receive posted under `seq`, by `deadline`."""

    def start_send(self, data: object, seq: int, deadline: float) -> Sending:
        """Start moving `data` as `send` does and return at once where the channel can (the
        sender then seals the next chunk meanwhile); `data` stays untouched until the wait.
        By default the send is done before this returns."""
        self.send(data, seq, deadline)
        return _Sent()

    @abstractmethod
    def landing(self, sink: BlockSink, header: BlockHeader) -> Landing:
        """Where request `header`'s payload lands on a keyless link (from `sink.staging`);
        TransferError refuses the request before any payload moves."""

    @abstractmethod
    def probe_landing(self, nbytes: int) -> object:
        """A buffer of `nbytes` that a probe's bytes, or a sealed payload, land in."""

    @abstractmethod
    def post_receive(self, buffer: object, seq: int) -> Receive:
        """Start receiving request `seq`'s payload into `buffer`."""

    @abstractmethod
    def abort(self) -> None:
        """Tear the channel down at once; operations in flight fail or are abandoned."""


class Carrier(ABC):
    """A transport's way of opening channels. `name` and `version` travel in the hello: a peer
    of another transport or version is refused before any channel opens."""

    name: str = ""
    version: int = 1

    def hello(self) -> bytes:
        """What the sender tells the receiver in its hello."""
        return b""

    def welcome(self, hello: bytes) -> bytes:
        """Receiver: what it answers a sender's `hello` with; TransferError refuses the link."""
        return b""

    @abstractmethod
    def open(self, control: Control, hello: bytes, welcome: bytes, deadline: float) -> Channel:
        """This side's channel of a link whose hello and welcome were exchanged, by `deadline`."""

    def close(self) -> None:
        """Release what the carrier holds (after every channel was aborted)."""

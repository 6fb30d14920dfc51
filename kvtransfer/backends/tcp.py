"""`tcp`: the link protocol with payloads on the control connection itself, written against the
channel contract alone (`_channel`): the proof that a transport needs nothing but a channel.

Between the accepting reply and the verdict nothing else travels on the control connection,
so the payload's bytes follow the reply there, unframed: the receiver knows their length from
the request's header (keyed, the sealed chunks follow one another, `_payload`). A payload cut short leaves the stream
out of step, so the receiver then drops the link. Host memory only; no registry entry (the
deployment's transports are ucx and nccl): tests and benchmarks build it directly.
"""
from __future__ import annotations

import socket
import time

from pdserve.common.errors import TransferError
from pdserve.kvtransfer.backends import _p2p, _payload
from pdserve.kvtransfer.backends._channel import Carrier, Channel, Control, Landing, Receive
from pdserve.kvtransfer.backends._link import P2PTransport


def _writable_bytes(buffer: object) -> memoryview:
    if hasattr(buffer, "element_size"):
        if buffer.is_cuda or not buffer.is_contiguous():
            raise TransferError("the tcp channel lands in contiguous host memory only")
        return memoryview(buffer.detach().reshape(-1).numpy()).cast("B")
    view = memoryview(buffer)
    if view.readonly:
        raise TransferError("the staging buffer is read-only")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class _StreamReceive(Receive):
    def __init__(self, sock: socket.socket, buffer: memoryview) -> None:
        self.sock, self.buffer = sock, buffer

    def wait(self, deadline: float, control) -> bool:
        got = 0
        while got < len(self.buffer):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.sock.settimeout(remaining)
            try:
                n = self.sock.recv_into(self.buffer[got:])
            except TimeoutError:
                continue
            if n == 0:  # the sender hung up
                return False
            got += n
        return True


class _StreamChannel(Channel):
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, data: object, seq: int, deadline: float) -> None:
        _p2p.send_all(self.sock, _payload.flat_bytes(data), deadline)

    def landing(self, sink, header) -> Landing:
        staging = sink.staging(header)
        view = _writable_bytes(staging)
        if len(view) != header.payload_len:
            raise TransferError(f"staging is {len(view)} bytes, payload {header.payload_len}")
        return Landing(staging, view)

    def probe_landing(self, nbytes: int) -> object:
        return memoryview(bytearray(nbytes))

    def post_receive(self, buffer: object, seq: int) -> Receive:
        return _StreamReceive(self.sock, _writable_bytes(buffer))

    def abort(self) -> None:
        """Nothing of its own: the protocol closes the control connection."""


class _StreamCarrier(Carrier):
    name = "tcp"

    def open(self, control: Control, hello: bytes, welcome: bytes, deadline: float) -> Channel:
        return _StreamChannel(control.sock)


class TcpTransport(P2PTransport):
    """KV blocks on the link's own TCP connection."""

    name = "tcp"

    def new_carrier(self) -> Carrier:
        return _StreamCarrier()


def create_transport(config) -> TcpTransport:
    """Listens on `config.host`; with a fixed `config.transfer_port`, the port two past it."""
    port = config.transfer_port + 2 if config.transfer_port else 0
    return TcpTransport(host=config.host, port=port, key=config.transfer_key)

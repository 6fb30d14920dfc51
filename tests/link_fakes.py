"""An in-memory payload channel for the link protocol (`kvtransfer.backends._link`): the whole
protocol (challenge, hellos, requests, probes, reconnects, admission) runs over real 127.0.0.1
control connections, and payloads move through a `FakeNetwork` in this process. No UCX, no
gloo. The network plays the channel's faults: bytes altered in flight, a channel that died
under a live control connection, a channel that stalls."""
from __future__ import annotations

import os
import threading
import time

from pdserve.common.errors import TransferError
from pdserve.kvtransfer.backends._channel import Carrier, Channel, Control, Landing, Receive
from pdserve.kvtransfer.backends._link import P2PTransport


class FakeNetwork:
    """Mailboxes keyed by (channel id, seq); `alter(bytes) -> bytes` rewrites payloads in flight;
    channel ids in `dead` take nothing (a send fails, nothing arrives)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.boxes: dict[tuple[bytes, int], bytes] = {}
        self.dead: set[bytes] = set()
        self.alter = None
        self.stall_s = 0.0
        self.num_sent = 0

    def deliver(self, channel_id: bytes, seq: int, data: bytes, deadline: float) -> None:
        if self.stall_s:
            time.sleep(min(self.stall_s, max(0.0, deadline - time.monotonic())))
        with self.cond:
            if channel_id in self.dead:
                raise TransferError("the fake channel is down")
            self.boxes[(channel_id, seq)] = self.alter(data) if self.alter else data
            self.num_sent += 1
            self.cond.notify_all()

    def take(self, channel_id: bytes, seq: int, deadline: float) -> bytes | None:
        with self.cond:
            while (channel_id, seq) not in self.boxes:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or channel_id in self.dead:
                    return None
                self.cond.wait(min(remaining, 0.05))
            return self.boxes.pop((channel_id, seq))


def _flat(obj: object) -> memoryview:
    if hasattr(obj, "element_size"):
        return memoryview(obj.detach().contiguous().reshape(-1).numpy()).cast("B")
    view = memoryview(obj)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class _FakeReceive(Receive):
    def __init__(self, channel: "FakeChannel", buffer: memoryview, seq: int) -> None:
        self.channel, self.buffer, self.seq = channel, buffer, seq

    def wait(self, deadline: float, control) -> bool:
        data = self.channel.network.take(self.channel.channel_id, self.seq, deadline)
        if data is None or len(data) != len(self.buffer):
            return False
        self.buffer[:] = data
        return True


class FakeChannel(Channel):
    def __init__(self, network: FakeNetwork, channel_id: bytes) -> None:
        self.network, self.channel_id = network, channel_id
        self.num_aborted = 0

    def send(self, data: object, seq: int, deadline: float) -> None:
        self.network.deliver(self.channel_id, seq, bytes(_flat(data)), deadline)

    def landing(self, sink, header) -> Landing:
        staging = sink.staging(header)
        view = _flat(staging)
        if len(view) != header.payload_len:
            raise TransferError(f"staging is {len(view)} bytes, payload {header.payload_len}")
        return Landing(staging, view)

    def probe_landing(self, nbytes: int) -> object:
        return memoryview(bytearray(nbytes))

    def post_receive(self, buffer: object, seq: int) -> Receive:
        return _FakeReceive(self, _flat(buffer), seq)

    def abort(self) -> None:
        self.num_aborted += 1


class FakeCarrier(Carrier):
    name = "fake"

    def __init__(self, network: FakeNetwork) -> None:
        self.network = network

    def welcome(self, hello: bytes) -> bytes:
        return os.urandom(16)  # the channel's id: both sides' mailboxes

    def open(self, control: Control, hello: bytes, welcome: bytes, deadline: float) -> Channel:
        return FakeChannel(self.network, welcome)


class FakeTransport(P2PTransport):
    name = "fake"

    def __init__(self, network: FakeNetwork, key: bytes | None = None, port: int = 0) -> None:
        super().__init__("127.0.0.1", port, key)
        self.network = network

    def new_carrier(self) -> Carrier:
        return FakeCarrier(self.network)

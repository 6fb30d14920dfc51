"""gRPC channels to workers (the router's to decodes and prefills, a decode's to prefills), one
per address, reused across requests."""
from __future__ import annotations

import asyncio

import grpc

from pdserve.proto.pdserve.v1 import adapters_pb2_grpc, decode_pb2_grpc, kv_events_pb2_grpc, prefill_pb2_grpc
from pdserve.rpc.credentials import InternalTLS, internal_channel
from pdserve.security.credentials import CallSigner


CONNECT_TIMEOUT_S = 4.0  # a peer whose channel does not connect within this is unreachable


class WorkerChannels:
    """With a signer, every call to a worker carries the caller's credential (over mutual TLS
    when `tls`)."""

    def __init__(self, signer: CallSigner | None = None, tls: InternalTLS | None = None) -> None:
        self._signer = signer
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = internal_channel(address, self._signer, self._tls)
        return channel

    async def wait_ready(self, address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
        """Whether the channel to `address` is connected within `timeout_s` (an idle one starts
        connecting). A peer behind a partition answers no connect, and a call on a channel
        still connecting waits for it: this bounds that wait."""
        try:
            await asyncio.wait_for(self.channel(address).channel_ready(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def decode(self, address: str) -> decode_pb2_grpc.DecodeStub:
        return decode_pb2_grpc.DecodeStub(self.channel(address))

    def prefill(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        return prefill_pb2_grpc.PrefillStub(self.channel(address))

    def kv_events(self, address: str) -> kv_events_pb2_grpc.KVEventsStub:
        return kv_events_pb2_grpc.KVEventsStub(self.channel(address))

    def adapters(self, address: str) -> adapters_pb2_grpc.AdaptersStub:
        return adapters_pb2_grpc.AdaptersStub(self.channel(address))

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(grace=None)

"""Internal gRPC spends little before the caller is verified: on a real internal server
(`rpc.server.internal_server` with the credential interceptor, as workers and the registry
run it), anonymous calls with large messages are refused without their bytes being taken
in, messages over the service's limit are refused as their length arrives, and a signed call
still goes through. The flood comes from another process, so this process's memory is the
server's."""
from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

from pdserve.proto.pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from pdserve.rpc.credentials import InternalAuth, internal_channel
from pdserve.rpc.server import WORKER_MAX_RECEIVE_BYTES, internal_server, service_name
from pdserve.security.secret import ClusterSecret
from support import KeyBook, grpc_flood_argv

NUM_CALLS = 16



def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


class Echo(prefill_pb2_grpc.PrefillServicer):
    async def Prefill(self, request, context):
        return prefill_pb2.PrefillResponse(request_id=request.request_id)


async def flood(port: int, size: int) -> list[str]:
    proc = await asyncio.create_subprocess_exec(
        *grpc_flood_argv(f"127.0.0.1:{port}", "/pdserve.v1.Prefill/Prefill", NUM_CALLS, size), stdout=subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    return out.decode().split()


@pytest.mark.parametrize("size", [WORKER_MAX_RECEIVE_BYTES - (1 << 20), 60 << 20], ids=["under-limit", "60MiB"])
def test_anonymous_large_calls_cost_the_server_no_memory(size):
    secret = ClusterSecret(os.urandom(32))
    auth = InternalAuth(secret)
    name = service_name(prefill_pb2, "Prefill")

    async def run() -> tuple[list[str], float, float]:
        book = KeyBook(secret)
        server = internal_server(WORKER_MAX_RECEIVE_BYTES, auth.interceptors([name], lambda reason: None, book))
        prefill_pb2_grpc.add_PrefillServicer_to_server(Echo(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            before = rss_mib()
            peak = before
            task = asyncio.ensure_future(flood(port, size))
            while not task.done():
                peak = max(peak, rss_mib())
                await asyncio.wait({task}, timeout=0.02)
            codes = task.result()
            async with internal_channel(f"127.0.0.1:{port}", book.signer("decode-0")) as channel:
                reply = await prefill_pb2_grpc.PrefillStub(channel).Prefill(
                    prefill_pb2.PrefillRequest(request_id="real"), timeout=10)
            assert reply.request_id == "real"  # a signed call still goes through
            return codes, before, peak
        finally:
            await server.stop(0)

    codes, before, peak = asyncio.run(run())
    # over the limit, whichever comes first refuses it: the credential check or the length
    refusals = {"UNAUTHENTICATED"} if size < WORKER_MAX_RECEIVE_BYTES else {"UNAUTHENTICATED", "RESOURCE_EXHAUSTED"}
    assert len(codes) == NUM_CALLS and set(codes) <= refusals, codes
    # unbounded, the server would hold NUM_CALLS x size (240-960 MiB) at once
    assert peak - before < 64, f"server RSS grew {peak - before:.0f} MiB under {NUM_CALLS} x {size >> 20} MiB"

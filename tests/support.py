"""Helpers any test may import (`import support`): a real Redis server process, a clock
tests advance by hand, and tiny GGUF files.

The Redis server lives in the package (`pdserve.kvtransfer.local_redis`, shared with
`pdserve bench transfer`); tests stop it on teardown.
"""
from __future__ import annotations

from pathlib import Path

from pdserve.kvtransfer.local_redis import RedisServer, redis_server_binary

__all__ = ["FakeClock", "RedisServer", "redis_server_binary", "write_gguf"]


class FakeClock:
    """A clock for components that take one (`clock=`): time moves only when a test sets
    or adds to `now`, so cool-downs, TTLs and ages are tested without sleeping."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def write_gguf(path: Path, arch: str = "llama", *, shape_keys: bool = True,
               embed_rows: int = 16) -> Path:
    """A tiny GGUF file: tiny-model metadata, a 16-token vocabulary, one embedding tensor."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    if shape_keys:
        writer.add_context_length(64)
        writer.add_embedding_length(8)
        writer.add_block_count(1)
        writer.add_feed_forward_length(16)
        writer.add_head_count(2)
        writer.add_head_count_kv(1)
        writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(16)])
    writer.add_tensor("token_embd.weight", np.zeros((embed_rows, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def wait_until(condition, what: str, timeout: float = 30.0, poll_s: float = 0.01) -> None:
    """Poll `condition` until it holds; AssertionError naming `what` after `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


# A child process that makes `n` concurrent anonymous gRPC calls of `size` bytes to `method` on
# `target` (the bytes are sent raw, no credential) and prints each call's status, sorted.
GRPC_FLOOD = """
import concurrent.futures, sys, grpc
target, method, n, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
big = b"x" * size
channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 1 << 30)])
call = channel.unary_unary(method, request_serializer=bytes, response_deserializer=bytes)
def one(_):
    try:
        call(big, timeout=120)
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name
with concurrent.futures.ThreadPoolExecutor(n) as pool:
    print(" ".join(sorted(pool.map(one, range(n)))))
"""


def grpc_flood_argv(target: str, method: str, n: int, size: int) -> list[str]:
    import sys

    return [sys.executable, "-c", GRPC_FLOOD, target, method, str(n), str(size)]


class KeyBook:
    """A `KeyDirectory` for tests that run a protected server without a registry: every
    caller id gets its own key (minted on first use) and a role, as registration would bind."""

    def __init__(self, secret, role: str = "decode") -> None:
        self._secret = secret
        self._role = role
        self._keys: dict = {}  # caller id -> (CallKey, role)

    def signer(self, caller_id: str, role: str = "", **kwargs):
        """A signer with `caller_id`'s key (kwargs: CallSigner's, e.g. clock)."""
        from pdserve.security.credentials import CallKey, CallSigner

        if caller_id not in self._keys:
            self._keys[caller_id] = (CallKey(), role or self._role)
        return CallSigner(self._secret, caller_id, self._keys[caller_id][0], **kwargs)

    def identities(self, caller_id: str):
        from pdserve.security.credentials import Identity

        found = self._keys.get(caller_id)
        return (Identity(caller_id, found[1], found[0].public_key),) if found else ()

    async def refresh(self, caller_id: str) -> None:
        return None

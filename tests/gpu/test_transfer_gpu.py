"""The nccl backend's device-direct path on a GPU: KV blocks go from one cache to the other
without passing through host memory. Skipped without CUDA.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so with one GPU the pair's
process group is `_Loopback`: a device-to-device copy between the two ranks' tensors in this
process, standing in for NCCL's wire only. Everything else runs for real: the transports and
their control channel, the gather into a GPU tensor, the digest kernel, the sink's GPU
staging and the scatter on the GPU. Keyless (device-direct), host staging is refused outright
(the functions that copy a payload to the host raise); keyed, the payload is sealed on the
host and only its ciphertext crosses the loopback. `test_nccl_between_two_gpus` runs a real
NCCL pair where there are two GPUs.
"""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from pdserve.common.errors import TransferError
from pdserve.kernels import digest
from pdserve.kvtransfer.backends import _payload, nccl
from pdserve.kvtransfer.codec import encode_message, new_transfer_id
from pdserve.kvtransfer.sink import CacheSink
from pdserve.kvtransfer.wire import parse_header
from kvcaches import block_digests, make_caches, tiny_layout

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEADLINE_S = 30.0


@pytest.fixture(autouse=True)
def _triton_on_cuda(monkeypatch):
    monkeypatch.setenv("PDSERVE_USE_TRITON", "auto")


class _Work:
    def __init__(self, finish) -> None:
        self._finish = finish

    def wait(self, timeout=None) -> bool:
        self._finish(timeout.total_seconds() if timeout is not None else DEADLINE_S)
        return True


class _Loopback:
    """Both ranks of one pair: `send` posts the tensor, `recv` copies it GPU to GPU."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._posted: dict[int, tuple[torch.Tensor, threading.Event]] = {}
        self.corrupt_next = False

    def send(self, tensors, dst, tag):
        (tensor,) = tensors
        assert tensor.is_cuda, "the sender handed NCCL a host tensor"
        taken = threading.Event()
        with self._cond:
            self._posted[tag] = (tensor, taken)
            self._cond.notify_all()

        def finish(timeout_s):
            if not taken.wait(timeout_s):
                raise RuntimeError("loopback send: not received in time")
        return _Work(finish)

    def recv(self, tensors, src, tag):
        (landing,) = tensors
        assert landing.is_cuda, "the receiver landed the payload in host memory"

        def finish(timeout_s):
            with self._cond:
                if not self._cond.wait_for(lambda: tag in self._posted, timeout_s):
                    raise RuntimeError("loopback recv: nothing sent in time")
                tensor, taken = self._posted.pop(tag)
            landing.copy_(tensor)
            if self.corrupt_next:  # a bit flipped on the wire
                self.corrupt_next = False
                landing.view(-1)[landing.numel() // 2] ^= 4
            torch.cuda.current_stream().synchronize()
            taken.set()
        return _Work(finish)


def _loopback_groups(monkeypatch) -> dict[bytes, _Loopback]:
    """The pairs' groups become loopbacks."""
    pairs: dict[bytes, _Loopback] = {}
    lock = threading.Lock()

    def new_group(backend, store, rank, local_host, timeout_s):
        """The two ranks meet through the pair's store (the control connection), as NCCL's do."""
        assert backend == "nccl"
        if rank == 0:
            store.set("loopback", os.urandom(16))
        pair_token = bytes(store.get("loopback"))
        with lock:
            return pairs.setdefault(pair_token, _Loopback())

    monkeypatch.setattr(nccl, "_new_group", new_group)
    return pairs


@pytest.fixture
def sealed_loopback(monkeypatch):
    """Loopback pairs for keyed links (their payloads are sealed on the host)."""
    return _loopback_groups(monkeypatch)


@pytest.fixture
def loopback(monkeypatch):
    return _keyless_loopback(monkeypatch)


def _keyless_loopback(monkeypatch) -> dict[bytes, _Loopback]:
    """Loopback pairs for keyless links; every path that would copy a payload to the host
    raises."""
    pairs = _loopback_groups(monkeypatch)

    def no_host_copy(*args, **kwargs):
        raise AssertionError("a payload was copied to the host")

    monkeypatch.setattr(_payload, "flat_bytes", no_host_copy)
    from pdserve.kvtransfer import blocks, sink

    monkeypatch.setattr(blocks, "gather_to_host", no_host_copy)
    as_bytes_view = sink.as_bytes_view
    monkeypatch.setattr(sink, "as_bytes_view", lambda p: no_host_copy() if getattr(p, "is_cuda", False)
                        else as_bytes_view(p))
    return pairs


@pytest.mark.parametrize("nbytes", [4, 16384, 5 * 16384 + 12, 64 << 20])
def test_digest_kernel_matches_the_torch_path(nbytes):
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    key = digest.digest_key(os.urandom(32), "cuda")
    got = digest.payload_digest(payload, key)
    assert got.is_cuda and torch.equal(got, digest._torch_digest(payload.view(torch.int32), key))
    if nbytes <= 16384:
        data = payload.cpu().numpy().tobytes()
        assert digest.payload_digest(payload, digest.digest_key(b"s", "cuda")).tolist() == \
            digest.reference_digest(data, b"s")


def _device_message(layout, source, tid, src, dst):
    from pdserve.kvtransfer.blocks import gather_for_send
    from pdserve.kvtransfer.sink import limits_for

    payload, ready = gather_for_send(source, src, keep_on_device=True)
    ready.synchronize()
    assert payload.is_cuda
    return encode_message(limits_for(layout), tid, dst, [0] * len(dst), payload)


def _send_and_flip(sender, receiver, sink, layout, source, pairs, match: str) -> None:
    """A message lands bit-identical; the next, a bit flipped on the wire, is refused (`match`)
    and changes nothing; sent again it lands."""
    endpoint = receiver.open_receiver(sink)
    tid = new_transfer_id()
    sink.expect(tid, [4, 9, 2], time.monotonic() + DEADLINE_S)
    message = _device_message(layout, source, tid, [1, 5, 7], [4, 9, 2])
    assert parse_header(message.header, sink.limits).device_digest
    before = block_digests(sink.kv_caches, [4, 9, 2])
    sender.send(endpoint, message, time.monotonic() + DEADLINE_S)
    assert sink.is_complete(tid)
    assert block_digests(sink.kv_caches, [4, 9, 2]) == block_digests(source, [1, 5, 7]) != before

    tid = new_transfer_id()
    sink.expect(tid, [3], time.monotonic() + DEADLINE_S)
    (group,) = pairs.values()  # the pair the first send opened
    group.corrupt_next = True
    with pytest.raises(TransferError, match=match):
        sender.send(endpoint, _device_message(layout, source, tid, [6], [3]), time.monotonic() + DEADLINE_S)
    assert block_digests(sink.kv_caches, [3]) == block_digests(make_caches(layout), [3])
    sender.send(endpoint, _device_message(layout, source, tid, [6], [3]), time.monotonic() + DEADLINE_S)
    assert sink.is_complete(tid) and block_digests(sink.kv_caches, [3]) == block_digests(source, [6])


def _gpu_pair_flip(loopback, key: bytes | None, match: str) -> None:
    """A GPU cache sent over an nccl pair (keyed or not) lands; a flipped bit is refused."""
    layout = tiny_layout(num_blocks=16, dtype="bfloat16")
    source = [c.cuda() for c in make_caches(layout, seed=3)]
    sink = CacheSink([c.cuda() for c in make_caches(layout)], layout)
    receiver, sender = nccl.NcclTransport(backend="nccl", key=key), nccl.NcclTransport(backend="nccl", key=key)
    assert sender.device_direct == (key is None)
    try:
        _send_and_flip(sender, receiver, sink, layout, source, loopback, match)
    finally:
        sender.close()
        receiver.close()


def test_nccl_device_direct_lands_on_the_gpu_and_refuses_a_flipped_bit(loopback):
    """Keyless (`--insecure-internal`): device to device, the sink's checksum catches a flip."""
    _gpu_pair_flip(loopback, None, "checksum")


def test_nccl_keyed_seals_on_the_host_lands_on_the_gpu_and_refuses_a_flipped_bit(sealed_loopback):
    """With a transfer key, a GPU payload is sealed on the host (AEAD), only ciphertext crosses
    NCCL, it lands in the GPU cache; a flipped bit fails its tag and nothing lands."""
    _gpu_pair_flip(sealed_loopback, os.urandom(32), "AEAD")


def test_a_gpu_message_through_a_host_path_is_checked_on_the_gpu(monkeypatch):
    """A GPU sender's message (digest checksum) that a GPU decode received into host staging
    (a fallback through ucx or gloo: check, staging, commit) is moved to the GPU and checked
    there, not by the slow CPU digest; a corrupt one is still refused."""
    from pdserve.kvtransfer.wire import WireError

    layout = tiny_layout(num_blocks=16, dtype="bfloat16")
    source = [c.cuda() for c in make_caches(layout, seed=7)]
    sink = CacheSink([c.cuda() for c in make_caches(layout)], layout)
    tid = new_transfer_id()
    sink.expect(tid, [2, 8], time.monotonic() + DEADLINE_S)
    message = _device_message(layout, source, tid, [3, 11], [2, 8])
    header = parse_header(message.header, sink.limits)
    monkeypatch.setattr(digest, "_torch_digest", lambda *a: (_ for _ in ()).throw(AssertionError("CPU digest")))
    for corrupt in (True, False):
        sink.check(header, message.index)
        staging = sink.staging(header)  # what a host transport asks for
        assert staging.device.type == "cpu"
        staging.copy_(message.payload.reshape(-1).view(torch.uint8).cpu())
        if corrupt:
            staging[-3] ^= 1
            with pytest.raises(WireError, match="checksum"):
                sink.commit(header, message.index, staging)
        else:
            sink.commit(header, message.index, staging)
    assert sink.is_complete(tid) and block_digests(sink.kv_caches, [2, 8]) == block_digests(source, [3, 11])


@pytest.mark.parametrize("keyed", [False, True])
def test_disaggregated_engines_on_the_gpu_over_nccl_equal_local_greedy(keyed, monkeypatch, tiny_model_factory):
    """Two engines on the GPU, the chain nccl -> recompute, layer-wise streaming on: keyless,
    the prompt's blocks go device to device (no host copy anywhere); keyed, sealed on the
    host. Greedy tokens equal a local engine's, and every block is back in both pools."""
    from pdserve.kvtransfer import KVTransferConfig
    from pdserve.kvtransfer.verdict import RECOMPUTE
    from engine_pair import GREEDY, assert_all_blocks_back, disaggregated, engines

    model_dir = tiny_model_factory("llama")
    (_loopback_groups if keyed else _keyless_loopback)(monkeypatch)
    config = KVTransferConfig(backends=("nccl", RECOMPUTE), step_timeout_s=DEADLINE_S,
                              transfer_key=os.urandom(32) if keyed else None)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (40, 45, 17)]
    with engines(model_dir, config, common=dict(device="cuda"), max_num_tokens=12) as (prefill, decode, local):
        assert prefill.engine.connector.worker.sends._device_direct() != keyed
        for i, prompt in enumerate(prompts):
            tokens, sent, received = disaggregated(prefill, decode, prompt, f"gpu{i}")
            assert sent.ok and sent.backend == "nccl" and received.ok, received.describe()
            assert sent.num_messages >= 1 and not sent.fallbacks
            assert tuple(tokens) == local.generate(prompt, GREEDY)[0].token_ids
        assert_all_blocks_back(prefill, decode)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs for a pair")
def test_nccl_between_two_gpus():
    """The real NCCL wire: sender's cache on cuda:0, receiver's on cuda:1."""
    layout = tiny_layout(num_blocks=16, dtype="bfloat16")
    source = [c.to("cuda:0") for c in make_caches(layout, seed=5)]
    sink = CacheSink([c.to("cuda:1") for c in make_caches(layout)], layout)
    key = os.urandom(32)
    receiver, sender = nccl.NcclTransport(backend="nccl", key=key), nccl.NcclTransport(backend="nccl", key=key)
    try:
        endpoint = receiver.open_receiver(sink)
        tid = new_transfer_id()
        sink.expect(tid, [4, 9], time.monotonic() + DEADLINE_S)
        sender.send(endpoint, _device_message(layout, source, tid, [1, 5], [4, 9]), time.monotonic() + DEADLINE_S)
        assert sink.is_complete(tid)
        assert block_digests(sink.kv_caches, [4, 9]) == block_digests(source, [1, 5])
    finally:
        sender.close()
        receiver.close()

"""Issue 38 (3) on real processes: the nccl backend's receiver keeps no anonymous listener.

The attack it reproduces: a torch TCPStore took any client's keys (twelve 8 MB values grew a
decode by 120 MB) and showed the pairing keys. Here an outside client speaks the TCPStore
protocol (`store_set`, checked against a real TCPStore first) to every port the receiving
process listens on, twelve 8 MB values each: each attempt is refused (cut off by the
authenticated control listener, or no connection at all on a gloo device's listener), the
process keeps neither the bytes nor the connections, and transfers go on, on the pair made
before and on a new one, KV equal and no block left reserved.

The receiver is this file run as a script (`python test_nccl_listeners.py`): an nccl (gloo)
transport over a CacheSink of real caches, obeying JSON-line commands; nothing is pickled.
"""
from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

import pytest

from pdserve.lab.child import Child, serve_commands

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: `kvcaches`, `store_attack`
from store_attack import NUM_VALUES, VALUE_BYTES, attack, attack_all, listening_ports  # noqa: E402

LAYOUT_ARGS = dict(num_blocks=32, num_layers=2, block_size=16, num_kv_heads=2, head_dim=64)
DEADLINE_S = 10.0
# -- the receiving process -----------------------------------------------------------------------
def peer_main() -> None:
    import torch

    torch.set_num_threads(1)
    from pdserve.kvtransfer.backends.nccl import NcclTransport
    from pdserve.kvtransfer.sink import CacheSink
    from kvcaches import block_digests, make_caches, tiny_layout

    layout = tiny_layout(**LAYOUT_ARGS)
    caches = make_caches(layout)
    sink = CacheSink(caches, layout)
    transport: list[NcclTransport] = []

    def handle(cmd: dict) -> dict:
        if cmd["cmd"] == "open":
            transport.append(NcclTransport(backend="gloo", key=bytes.fromhex(cmd["key"])))
            return {"endpoint": transport[0].open_receiver(sink)}
        if cmd["cmd"] == "expect":
            sink.expect(bytes.fromhex(cmd["transfer_id"]), cmd["blocks"], time.monotonic() + DEADLINE_S)
            return {}
        if cmd["cmd"] == "digests":
            return {"digests": block_digests(caches, cmd["blocks"])}
        if cmd["cmd"] == "stats":
            with open("/proc/self/status") as f:
                rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            (receiver,) = transport[0]._receivers
            sink.expire_overdue()
            return {"rss_kib": rss_kib, "fds": len(os.listdir("/proc/self/fd")),
                    "ports": sorted(listening_ports()), "pending": receiver.gate.num_pending,
                    "pairs": len(receiver._threads), "reserved": sorted(sink.reserved_block_ids),
                    "transfers": sorted(t.hex() for t in sink.pending_transfer_ids)}
        raise ValueError(f"unknown command {cmd['cmd']!r}")

    serve_commands(handle)


class Peer(Child):
    def __init__(self, log_path) -> None:
        super().__init__([sys.executable, __file__], log_path)

    def ok(self, cmd: str, timeout_s: float | None = None, **args) -> dict:
        reply = self.call(cmd, timeout_s, **args)
        assert reply["ok"], f"{cmd}: {reply.get('error')}"
        return reply


@pytest.fixture
def receiver(tmp_path):
    key = os.urandom(32)
    peer = Peer(tmp_path / "peer.log")
    try:
        peer.endpoint = peer.ok("open", timeout_s=120, key=key.hex())["endpoint"]
        peer.key = key
        yield peer
    finally:
        peer.stop()


def send_and_check(peer: Peer, sender, src, dst, seed: int) -> None:
    """One real transfer into `dst`, landed bit-identical and released."""
    from pdserve.kvtransfer.codec import new_transfer_id
    from kvcaches import block_digests, make_caches, message_from_cache, tiny_layout

    layout = tiny_layout(**LAYOUT_ARGS)
    source = make_caches(layout, seed=seed)
    message = message_from_cache(source, layout, new_transfer_id(), src, dst)
    peer.ok("expect", transfer_id=message.transfer_id.hex(), blocks=list(dst))
    sender.send(peer.endpoint, message, time.monotonic() + DEADLINE_S)
    assert peer.ok("digests", blocks=list(dst))["digests"] == block_digests(source, src)
    stats = peer.ok("stats")
    assert stats["reserved"] == [] and stats["transfers"] == [], stats


def sender_for(peer: Peer):
    from pdserve.kvtransfer.backends.nccl import NcclTransport

    return NcclTransport(backend="gloo", key=peer.key)


def test_the_attack_sets_keys_on_a_torch_tcpstore():
    """The reproduction's bytes do what the issue saw on the old receiver's store."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=DEADLINE_S),
                          wait_for_workers=False, use_libuv=True)
    assert attack(store.port, "pdkv/junk/0") == "sent"
    assert len(store.get("pdkv/junk/0")) == VALUE_BYTES


def test_the_receiver_listens_on_its_endpoint_and_each_pairs_closed_gloo_port(receiver):
    endpoint_port = int(receiver.endpoint.rsplit(":", 1)[1])
    assert receiver.ok("stats")["ports"] == [endpoint_port]  # no store server
    ours_before = listening_ports()
    sender = sender_for(receiver)
    try:
        send_and_check(receiver, sender, [1, 2], [3, 4], seed=1)
        gloo_ports = set(receiver.ok("stats")["ports"]) - {endpoint_port}
        sender_ports = listening_ports() - ours_before
        assert len(gloo_ports) == 1 and len(sender_ports) == 1, (gloo_ports, sender_ports)  # each side's device
        for port in gloo_ports | sender_ports:  # both sides' gloo listeners, once paired
            assert attack(port, "pdkv/junk/probe") == "no connection", port
    finally:
        sender.close()


def test_a_sender_of_the_store_pairing_is_refused(receiver, monkeypatch):
    """Hello version 3 paired through a TCPStore: such a sender gets no pair, and nothing lands."""
    from pdserve.common.errors import TransferError
    from pdserve.kvtransfer.backends import nccl

    monkeypatch.setattr(nccl, "HELLO_VERSION", 3)
    sender = sender_for(receiver)
    try:
        with pytest.raises((TransferError, TimeoutError)):
            send_and_check(receiver, sender, [1], [6], seed=5)
        deadline = time.monotonic() + DEADLINE_S
        while (stats := receiver.ok("stats"))["pairs"]:  # its thread ends as it closes the connection
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        assert len(stats["ports"]) == 1, stats  # no gloo device was made for it
    finally:
        sender.close()


def test_an_outsider_on_every_port_is_refused_and_transfers_go_on(receiver):
    sender = sender_for(receiver)
    try:
        send_and_check(receiver, sender, [0, 5, 9], [2, 7, 30], seed=2)  # a pair, before the attack
        before = receiver.ok("stats")
        assert before["pairs"] == 1 and len(before["ports"]) == 2, before
        outcomes = attack_all(before["ports"])
        endpoint_port = int(receiver.endpoint.rsplit(":", 1)[1])
        for port, seen in outcomes.items():
            expected = {"cut off"} if port == endpoint_port else {"no connection"}
            assert seen == expected, (port, outcomes)
        deadline = time.monotonic() + DEADLINE_S
        while (after := receiver.ok("stats"))["fds"] > before["fds"] or after["pending"]:
            assert time.monotonic() < deadline, f"connections kept: {before} -> {after}"
            time.sleep(0.05)
        grown_mib = (after["rss_kib"] - before["rss_kib"]) / 1024
        assert grown_mib < 32, f"RSS grew {grown_mib:.0f} MiB under {NUM_VALUES * VALUE_BYTES >> 20} MiB sent per port"
        assert after["ports"] == before["ports"] and after["pairs"] == 1, after
        send_and_check(receiver, sender, [11, 12], [13, 14], seed=3)  # the pair made before
        late = sender_for(receiver)
        try:
            send_and_check(receiver, late, [20], [21], seed=4)  # a pair made after
        finally:
            late.close()
    finally:
        sender.close()


if __name__ == "__main__":
    peer_main()

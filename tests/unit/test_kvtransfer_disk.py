"""The disk store on a real directory: records, corruption, LRU pruning, sharing between
processes, and an unusable directory."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from pdserve.common.block_hash import DIGEST_BYTES
from pdserve.kvtransfer.backends.disk import DiskStore
from pdserve.kvtransfer.codec import encode_message, record_nbytes
from pdserve.kvtransfer.health import HealthPolicy
from pdserve.kvtransfer.sink import limits_for
from kvcaches import tiny_layout
from pdserve.kvtransfer.wire import payload_nbytes
from support import FakeClock

LAYOUT = tiny_layout(num_blocks=16)
LIMITS = limits_for(LAYOUT)
COMPAT = LIMITS.compat_hash
BLOCK_NBYTES = payload_nbytes(1, LAYOUT.num_layers, LAYOUT.block_size, LAYOUT.num_kv_heads,
                              LAYOUT.head_dim, LAYOUT.dtype)


def block_bytes(key: int) -> bytes:
    """Deterministic payload of one block, derived from its key."""
    seed = (key % 251).to_bytes(1, "little")
    return (seed * BLOCK_NBYTES)[:BLOCK_NBYTES]


def message(keys):
    payload = b"".join(block_bytes(k) for k in keys)
    return encode_message(LIMITS, bytes(16), [0] * len(keys), keys, payload)


def test_put_get_roundtrip_and_prefix_hits(tmp_path):
    store = DiskStore(tmp_path)
    assert store.put([11, 12, 13], message([11, 12, 13])) == 3
    got = store.get([11, 99, 13], LIMITS)
    assert bytes(got[0]) == block_bytes(11) and got[1] is None and bytes(got[2]) == block_bytes(13)
    assert store.count_prefix_hits([11, 12, 99, 13], COMPAT) == 2
    assert store.count_prefix_hits([11, 12], COMPAT + 1) == 0  # other model: other namespace
    assert store.put([11], message([11])) == 1  # already there: counted, not rewritten
    assert len(list(tmp_path.rglob("*.kv"))) == 3


def test_short_lived_keys_and_discard(tmp_path):
    clock = FakeClock(time.time())
    store = DiskStore(tmp_path, ephemeral_ttl_s=0.3, clock=clock)
    assert store.put([5, -77], message([5, -77])) == 2
    assert bytes(store.get([-77], LIMITS)[0]) == block_bytes(-77)
    store.discard([-77], COMPAT)
    assert store.get([-77], LIMITS) == [None]
    store.put([-78], message([-78]))
    store.prune()
    assert store.get([-78], LIMITS)[0] is not None  # not yet expired
    clock.now += 0.35
    store.prune()  # past their TTL: pruned first, whatever the budgets
    assert store.get([-78, 5], LIMITS)[0] is None and store.get([5], LIMITS)[0] is not None


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "other-key"])
def test_corrupt_record_is_a_miss_and_is_deleted(tmp_path, damage):
    store = DiskStore(tmp_path)
    store.put([21, 22], message([21, 22]))
    path = store.path_of(COMPAT, 21)
    data = path.read_bytes()
    if damage == "flip":
        at = len(data) - DIGEST_BYTES - 4  # a payload byte (the block's digest follows it)
        data = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]
    elif damage == "truncate":
        data = data[:-10]
    elif damage == "empty":
        data = b""
    else:
        data = store.path_of(COMPAT, 22).read_bytes()  # a valid record filed under another key
    path.write_bytes(data)
    assert store.get([21, 22], LIMITS)[0] is None
    assert not path.exists()
    assert store.get([22], LIMITS)[0] is not None


def _age(store: DiskStore, key: int, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    os.utime(store.path_of(COMPAT, key), (t, t))


def test_prune_by_count_least_recently_used_first(tmp_path):
    store = DiskStore(tmp_path, max_records=10, prune_interval_s=1e9)
    keys = list(range(100, 110))
    store.put(keys, message(keys))
    for i, key in enumerate(keys):  # 100 is the oldest ... 109 the newest
        _age(store, key, 100 - i)
    store.get([100, 101], LIMITS)  # reading marks them used now
    store.put([200], message([200]))  # 11 records > 10: prune to 9
    remaining = {k for k in keys + [200] if store.path_of(COMPAT, k).exists()}
    assert remaining == {100, 101, 200, *range(104, 110)}, sorted(remaining)


def test_prune_by_size(tmp_path):
    size = record_nbytes(LIMITS)
    store = DiskStore(tmp_path, max_bytes=5 * size, prune_interval_s=1e9)
    for key in range(1, 8):
        store.put([key], message([key]))
        _age(store, key, 100 - key)
    total = sum(p.stat().st_size for p in tmp_path.rglob("*.kv"))
    assert total <= 5 * size
    assert store.path_of(COMPAT, 7).exists() and not store.path_of(COMPAT, 1).exists()
    assert store.num_pruned >= 2


def test_stale_temp_files_are_cleaned(tmp_path):
    store = DiskStore(tmp_path)
    store.put([1], message([1]))
    stale = store.path_of(COMPAT, 1).parent / ".dead-writer.tmp"
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    fresh = stale.with_name(".live-writer.tmp")
    fresh.write_bytes(b"partial")
    store.prune()
    assert not stale.exists() and fresh.exists()


def test_unusable_directory_is_unhealthy_then_probed_back(tmp_path):
    root = tmp_path / "store"
    clock = FakeClock(time.time())
    store = DiskStore(root, health_policy=HealthPolicy(failure_threshold=1, cooldown_s=0.2), clock=clock)
    assert store.put([1], message([1])) == 1
    shutil.rmtree(root)
    root.write_text("a file where the directory was")  # unwritable even for root
    assert store.put([2], message([2])) == 0
    assert not store.health.is_healthy
    assert store.get([1], LIMITS) == [None] and store.count_prefix_hits([1], COMPAT) == 0
    root.unlink()
    assert store.put([3], message([3])) == 0  # cooling down: not even tried
    clock.now += 0.25
    assert store.put([3], message([3])) == 1  # cool-down over: a probe succeeds, back in use
    assert store.health.is_healthy


WORKER = textwrap.dedent("""
    import sys, time
    from pdserve.kvtransfer.backends.disk import DiskStore  # no torch: a light process
    from pdserve.kvtransfer.codec import encode_message
    from pdserve.kvtransfer.wire import WireLimits
    limits = WireLimits(*{limits!r})
    nbytes = {block_nbytes}
    def block_bytes(key):
        return ((key % 251).to_bytes(1, "little") * nbytes)[:nbytes]
    store = DiskStore(sys.argv[1], max_records=40, prune_interval_s=0.05)
    seed, end, n_get, i = int(sys.argv[2]), time.monotonic() + 1.5, 0, 0
    while time.monotonic() < end:
        keys = [(seed * 7 + i * 3 + j) % 120 + 1 for j in range(4)]
        payload = b"".join(block_bytes(k) for k in keys)
        store.put(keys, encode_message(limits, bytes(16), [0] * 4, keys, payload))
        for key, got in zip(keys, store.get(keys, limits)):
            if got is not None:
                assert bytes(got) == block_bytes(key), key  # whole records only
                n_get += 1
        i += 1
    assert store.health.is_healthy, store.health.last_error
    assert "torch" not in sys.modules
    print(n_get)
""")


def test_several_processes_share_one_directory(tmp_path):
    """Writers, readers and pruners in two processes at once: no partial record is ever
    read, no error escapes, and the budget holds afterwards."""
    script = WORKER.format(limits=tuple(getattr(LIMITS, f) for f in LIMITS.__slots__),
                           block_nbytes=BLOCK_NBYTES)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(seed)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in (1, 2)]
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
        assert int(out.strip()) > 0
    DiskStore(tmp_path, max_records=40).prune()
    assert len(list(tmp_path.rglob("*.kv"))) <= 40
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_planted_record_does_not_block_its_replacement(tmp_path):
    """Issue 25, item 7: a record planted under a block's name (no valid MAC) is replaced by
    the next put of that block, and reads as a miss until then."""
    key = os.urandom(32)
    store = DiskStore(tmp_path, mac_key=key)
    path = store.path_of(COMPAT, 31)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"planted" * 100)
    assert store.get([31], LIMITS)[0] is None and store.num_unauthenticated == 1  # refused and dropped
    path.write_bytes(b"planted" * 100)
    assert store.put([31], message([31])) == 1  # replaced, not kept as "already stored"
    assert bytes(store.get([31], LIMITS)[0]) == block_bytes(31)
    other = DiskStore(tmp_path / "b", mac_key=os.urandom(32))  # another deployment's valid record
    other.put([32], message([32]))
    planted = store.path_of(COMPAT, 32)
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_bytes(other.path_of(COMPAT, 32).read_bytes())
    assert store.put([32], message([32])) == 1
    assert bytes(store.get([32], LIMITS)[0]) == block_bytes(32)


def test_opens_never_follow_symlinks(tmp_path):
    """Issue 25, item 7: a symlink (or a fifo) planted under a record's name is never
    followed: a read is a miss that removes the link (its target untouched), a put replaces
    the link with a record (its target untouched), and a fifo does not hang a read."""
    store = DiskStore(tmp_path / "kv")
    store.put([41], message([41]))
    target = tmp_path / "victim-file"
    target.write_bytes(store.path_of(COMPAT, 41).read_bytes())  # a valid record, outside the store
    link = store.path_of(COMPAT, 42)
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, link)
    assert store.count_prefix_hits([42], COMPAT) == 0
    assert store.get([42], LIMITS)[0] is None and not os.path.lexists(link)
    os.symlink(target, link)
    assert store.put([42], message([42])) == 1
    assert not link.is_symlink() and bytes(store.get([42], LIMITS)[0]) == block_bytes(42)
    assert target.read_bytes()[:4] == store.path_of(COMPAT, 41).read_bytes()[:4]  # untouched
    fifo = store.path_of(COMPAT, 43)
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    assert store.get([43], LIMITS)[0] is None and not os.path.lexists(fifo)
    assert store.put([43], message([43])) == 1 and bytes(store.get([43], LIMITS)[0]) == block_bytes(43)


@pytest.mark.parametrize("level", ["compat", "prefix"])
def test_a_symlinked_folder_at_any_level_is_never_gone_through(tmp_path, level):
    """A folder on a record's way replaced by a symlink to a place outside the store (the
    compatibility folder or the key-prefix one): nothing is read, written or deleted there;
    the link itself is removed and the store goes on in a real folder."""
    store = DiskStore(tmp_path / "kv")
    outside = tmp_path / "outside"
    store.put([0x4100000000000001], message([0x4100000000000001]))
    record = store.path_of(COMPAT, 0x4100000000000001)
    folder = record.parent.parent if level == "compat" else record.parent
    shutil.copytree(folder, outside)  # a valid copy of what was there, outside
    shutil.rmtree(folder)
    os.symlink(outside, folder)
    before = sorted((p.name, p.stat().st_size) for p in outside.rglob("*"))
    assert store.get([0x4100000000000001], LIMITS)[0] is None  # not read through the link
    assert not os.path.lexists(folder)  # the link is gone, not what it pointed to
    os.symlink(outside, folder)
    store.discard([0x4100000000000001], COMPAT)  # not deleted through it
    assert store.put([0x4100000000000002], message([0x4100000000000002])) == 0  # not written through it
    assert not os.path.lexists(folder)  # the put removed the link
    assert sorted((p.name, p.stat().st_size) for p in outside.rglob("*")) == before
    assert store.put([0x4100000000000002], message([0x4100000000000002])) == 1
    assert bytes(store.get([0x4100000000000002], LIMITS)[0]) == block_bytes(0x4100000000000002)


def test_records_and_folders_are_private(tmp_path):
    import stat as stat_

    store = DiskStore(tmp_path / "kv")
    store.put([7], message([7]))
    record = store.path_of(COMPAT, 7)
    assert stat_.S_IMODE(record.stat().st_mode) == 0o600
    assert stat_.S_IMODE(record.parent.stat().st_mode) == 0o700
    assert stat_.S_IMODE(record.parent.parent.stat().st_mode) == 0o700

"""A directory of KV blocks: the disk store, and the persistent prefix cache.

Layout::

    <root>/<compat hash, 16 hex>/<first 2 hex of the key>/<key, 16 hex>.kv    content blocks
    <root>/<compat hash, 16 hex>/eph/t<-key, 16 hex>.kv                      short-lived blocks

Each record is a single-block wire message (codec.split_records), so a reader checks it on
its own. Several processes may share the directory (a volume shared by pods):

* writes go to a temp file in the record's own folder, then `os.replace` onto the name: a
  reader sees the whole old record, the whole new one, or none, never a partial one;
* a read touches the record's mtime, and pruning deletes least recently touched first
  (mtime, not atime: many mounts are noatime/relatime);
* pruning tolerates records vanishing under it (another process pruned or read-deleted them);
* a record that fails its checks is deleted and reads as a miss.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Sequence

from pdserve.kvtransfer.base import BlockMessage, BlockStore
from pdserve.kvtransfer.codec import (UnauthenticatedRecord, decode_record, layout_of, record_nbytes,
                                      split_records)
from pdserve.kvtransfer.health import BackendHealth, HealthPolicy
from pdserve.kvtransfer.wire import WireError, WireLimits

log = logging.getLogger(__name__)

_SUFFIX = ".kv"
_TEMP_MAX_AGE_S = 600.0  # a temp file this old belongs to a writer that died
_LOW_WATERMARK = 0.9  # pruning goes down to this share of each budget


class DiskStore(BlockStore):
    name = "disk"

    def __init__(self, root: str | os.PathLike, *, max_bytes: int = 20 * 2**30,
                 max_records: int = 1_000_000, ephemeral_ttl_s: float = 120.0,
                 prune_interval_s: float = 30.0, health_policy: HealthPolicy = HealthPolicy(),
                 clock: Callable[[], float] = time.time, mac_key: bytes | None = None) -> None:
        """`clock` is wall time (record ages compare with file mtimes); tests inject one.
        `mac_key`: the deployment's store key; records are written with a MAC and a record
        without a valid one is a miss (counted in `num_unauthenticated`) and deleted."""
        if max_bytes <= 0 or max_records <= 0:
            raise ValueError("max_bytes and max_records must be positive")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.max_records = max_records
        self.ephemeral_ttl_s = ephemeral_ttl_s
        self.prune_interval_s = prune_interval_s
        self._clock = clock
        self.mac_key = mac_key
        self.num_unauthenticated = 0
        self.health = BackendHealth(self.name, health_policy, clock)
        self._lock = threading.Lock()  # guards the estimate below, not the files
        self._est_bytes = 0
        self._est_records = 0
        self._last_scan = float("-inf")
        self.num_pruned = 0
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # an unusable directory is an unhealthy store, not a crash
            self._trouble("open", exc)

    # -- keys -----------------------------------------------------------------------------
    def path_of(self, compat_hash: int, key: int) -> Path:
        base = self.root / f"{compat_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}"
        if key < 0:
            return base / "eph" / f"t{-key:016x}{_SUFFIX}"
        name = f"{key:016x}"
        return base / name[:2] / f"{name}{_SUFFIX}"

    # -- BlockStore ---------------------------------------------------------------------
    def put(self, block_hashes: Sequence[int], message: BlockMessage) -> int:
        if not self.can_serve():
            return 0
        compat = layout_of(message).compat_hash
        stored = written = num_new = 0
        try:
            for key, record in zip(block_hashes, split_records(message, block_hashes, self.mac_key)):
                path = self.path_of(compat, key)
                if key >= 0 and _touch(path):
                    stored += 1  # content-addressed: the same key holds the same bytes
                    continue
                _write_atomic(path, record)
                stored += 1
                num_new += 1
                written += len(record)
        except OSError as exc:
            self._trouble("put", exc)
        else:
            self.health.record_success()
        self._account(written, num_new)
        return stored

    def get(self, block_hashes: Sequence[int], limits: WireLimits) -> list[memoryview | None]:
        out: list[memoryview | None] = [None] * len(block_hashes)
        if not self.can_serve():
            return out
        expected = record_nbytes(limits, keyed=self.mac_key is not None)
        for i, key in enumerate(block_hashes):
            path = self.path_of(limits.compat_hash, key)
            try:
                with open(path, "rb") as f:
                    data = f.read(expected + 1)  # never more than one record's worth
            except FileNotFoundError:
                continue
            except OSError as exc:
                self._trouble("get", exc)
                break
            try:
                out[i] = decode_record(data, limits, key, self.mac_key)
            except UnauthenticatedRecord as exc:
                self.num_unauthenticated += 1
                log.warning("disk store: refusing record %s: %s", path, exc)
                _unlink(path)
                continue
            except WireError as exc:
                log.warning("disk store: dropping corrupt record %s: %s", path, exc)
                _unlink(path)
                continue
            _touch(path)
        return out

    def count_prefix_hits(self, block_hashes: Sequence[int], compat_hash: int) -> int:
        if not self.can_serve():
            return 0
        n = 0
        for key in block_hashes:
            if not self.path_of(compat_hash, key).is_file():
                break
            n += 1
        return n

    def discard(self, block_hashes: Sequence[int], compat_hash: int) -> None:
        for key in block_hashes:
            _unlink(self.path_of(compat_hash, key))

    def probe(self) -> bool:
        probe = self.root / f".probe.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            self._trouble("probe", exc)
            return False
        self.health.record_success()
        return True

    def close(self) -> None:
        pass  # nothing held open between calls

    # -- pruning ------------------------------------------------------------------------
    def prune(self) -> int:
        """Delete least recently used records until under both budgets (to the low-water
        mark), expired short-lived records and abandoned temp files. Returns records deleted."""
        now = self._clock()
        records: list[tuple[float, int, str]] = []
        deleted = 0
        for path, st in _walk(self.root):
            name = os.path.basename(path)
            if name.endswith(".tmp"):
                if now - st.st_mtime > _TEMP_MAX_AGE_S:
                    _unlink(path)
                continue
            if not name.endswith(_SUFFIX):
                continue
            if name.startswith("t") and now - st.st_mtime > self.ephemeral_ttl_s:
                deleted += _unlink(path)
                continue
            records.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in records)
        count = len(records)
        if total > self.max_bytes or count > self.max_records:
            byte_goal = self.max_bytes * _LOW_WATERMARK
            count_goal = self.max_records * _LOW_WATERMARK
            records.sort()  # oldest mtime first = least recently used
            for _, size, path in records:
                if total <= byte_goal and count <= count_goal:
                    break
                deleted += _unlink(path)  # 0 if a racing pruner got there first
                total -= size
                count -= 1
        with self._lock:
            self._est_bytes, self._est_records = total, count
            self._last_scan = now
            self.num_pruned += deleted
        return deleted

    def _account(self, written: int, num_new: int) -> None:
        with self._lock:
            self._est_bytes += written
            self._est_records += num_new
            due = (self._est_bytes > self.max_bytes or self._est_records > self.max_records
                   or self._clock() - self._last_scan >= self.prune_interval_s)
        if due and written:
            try:
                self.prune()
            except OSError as exc:
                log.warning("disk store: pruning %s failed: %s", self.root, exc)

    def _trouble(self, what: str, exc: OSError) -> None:
        log.warning("disk store %s: %s failed: %s", self.root, what, exc)
        self.health.record_failure(f"{what}: {exc.__class__.__name__}: {exc}")


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _touch(path: Path) -> bool:
    """Mark a record used now. False if it does not exist."""
    try:
        os.utime(path)
        return True
    except FileNotFoundError:
        return False
    except OSError:
        return path.is_file()


def _unlink(path: str | Path) -> int:
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0
    except OSError as exc:
        log.warning("disk store: cannot delete %s: %s", path, exc)
        return 0


def _walk(root: Path):
    """(path, stat) of every file below root, tolerating entries that vanish meanwhile."""
    stack = [str(root)]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    yield entry.path, entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue

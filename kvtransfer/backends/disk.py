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
* a record that fails its checks (MAC, format, a symlink or other non-regular file planted
  under its name) is deleted and reads as a miss; a put over such a record replaces it (a
  planted record never blocks its own replacement); a valid record under the same key with
  the same digest is only touched;
* below the root nothing is reached through a symlink: each folder is opened from its
  parent's descriptor with O_NOFOLLOW, records too (then fstat: regular files only), so a
  symlinked folder at any level is neither read, written nor deleted through (the link
  itself is removed); records and folders are made 0600 and 0700.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Sequence

from pdserve.kvtransfer.base import BlockMessage, BlockStore
from pdserve.kvtransfer.codec import (CountsRecordReads, RecordReads, decode_record, layout_of,
                                      record_nbytes, split_records)
from pdserve.kvtransfer.config import DISK_STORE_MAX_GB, KVTransferConfig
from pdserve.kvtransfer.health import BackendHealth, HealthPolicy
from pdserve.kvtransfer.wire import WireError, WireLimits

log = logging.getLogger(__name__)

_SUFFIX = ".kv"
_TEMP_MAX_AGE_S = 600.0  # a temp file this old belongs to a writer that died
_LOW_WATERMARK = 0.9  # pruning goes down to this share of each budget


class DiskStore(CountsRecordReads, BlockStore):
    name = "disk"

    def __init__(self, root: str | os.PathLike, *, max_bytes: int = int(DISK_STORE_MAX_GB * 2**30),
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
        self._reads = RecordReads("disk store")
        self.health = BackendHealth(self.name, health_policy, clock)
        self._lock = threading.Lock()  # guards the estimate below, not the files
        self._est_bytes = 0
        self._est_records = 0
        self._last_scan = float("-inf")
        self.num_pruned = 0
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
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
    def put(self, block_hashes: Sequence[int], message: BlockMessage, digests: Sequence[bytes] = ()) -> int:
        if not self.can_serve():
            return 0
        layout = layout_of(message)
        stored = written = num_new = 0
        try:
            records = split_records(message, block_hashes, self.mac_key, digests)
            for i, (key, record) in enumerate(zip(block_hashes, records)):
                path = self.path_of(layout.compat_hash, key)
                if key >= 0 and self._holds(path, layout, key, digests[i] if i < len(digests) else None):
                    stored += 1  # content-addressed: a valid record of the same block is kept
                    continue
                try:
                    _write_atomic(self.root, path, record)
                except _NotARecord as exc:
                    log.warning("disk store: removing %s: %s", path.parent, exc)
                    _unlink_planted(self.root, path)
                    continue
                stored += 1
                num_new += 1
                written += len(record)
        except OSError as exc:
            self._trouble("put", exc)
        else:
            self.health.record_success()
        self._account(written, num_new)
        return stored

    def _holds(self, path: Path, limits: WireLimits, key: int, digest: bytes | None) -> bool:
        """Whether `path` holds a valid record of `key` (with `digest`, that one): then it is
        touched and kept. A planted, corrupt or other-prefix record is not: it gets replaced."""
        try:
            data = _read_record(self.root, path, record_nbytes(limits, keyed=self.mac_key is not None) + 1)
        except (_NotARecord, OSError):
            return False
        if data is None:
            return False
        try:
            decode_record(data, limits, key, self.mac_key, digest)
        except WireError:
            return False
        return _touch(self.root, path)

    def get(self, block_hashes: Sequence[int], limits: WireLimits,
            digests: Sequence[bytes] | None = None) -> list[memoryview | None]:
        out: list[memoryview | None] = [None] * len(block_hashes)
        if not self.can_serve():
            return out
        expected = record_nbytes(limits, keyed=self.mac_key is not None)
        for i, key in enumerate(block_hashes):
            path = self.path_of(limits.compat_hash, key)
            try:
                data = _read_record(self.root, path, expected + 1)  # never more than one record's worth
            except _NotARecord as exc:
                log.warning("disk store: removing %s: %s", path, exc)
                _unlink_planted(self.root, path)
                continue
            except OSError as exc:
                self._trouble("get", exc)
                break
            if data is not None:
                out[i] = self._check(path, data, limits, key, digests[i] if digests is not None else None)
        return out

    def _check(self, path: Path, data: bytes, limits: WireLimits, key: int,
               digest: bytes | None) -> memoryview | None:
        payload = self._reads.payload(data, limits, key, self.mac_key, digest, path,
                                      lambda: _unlink(self.root, path))
        if payload is None:
            return None
        _touch(self.root, path)
        return payload

    def count_prefix_hits(self, block_hashes: Sequence[int], compat_hash: int) -> int:
        if not self.can_serve():
            return 0
        n = 0
        for key in block_hashes:
            if not _is_regular(self.root, self.path_of(compat_hash, key)):
                break
            n += 1
        return n

    def discard(self, block_hashes: Sequence[int], compat_hash: int) -> None:
        for key in block_hashes:
            _unlink(self.root, self.path_of(compat_hash, key))

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
                    _unlink(self.root, path)
                continue
            if not name.endswith(_SUFFIX):
                continue
            if name.startswith("t") and now - st.st_mtime > self.ephemeral_ttl_s:
                deleted += _unlink(self.root, path)
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
                deleted += _unlink(self.root, path)  # 0 if a racing pruner got there first
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


def create_store(config: KVTransferConfig) -> DiskStore:
    """Registry factory: the directory `config.disk_store`, within its size and record budgets."""
    return DiskStore(config.disk_store, max_bytes=int(config.disk_store_max_gb * 2**30),
                     max_records=config.disk_store_max_records, ephemeral_ttl_s=config.ephemeral_ttl_s,
                     health_policy=config.health_policy, mac_key=config.store_key)


class _NotARecord(OSError):
    """Something other than a regular file under a record's name (a symlink, a fifo...), or
    a symlink where a folder should be."""


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


@contextlib.contextmanager
def _folder(root: Path, path: Path, create: bool = False):
    """(descriptor of `path`'s folder, its name in it), the folder reached from `root` one
    level at a time without following a link (_NotARecord if one is); FileNotFoundError if
    a level is missing and not `create`d (0700)."""
    if create:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        for part in path.relative_to(root).parts[:-1]:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o700, dir_fd=fd)
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _NotARecord(f"{part} is a symlink or not a folder") from None
                raise
            os.close(fd)
            fd = child
        yield fd, path.name
    finally:
        os.close(fd)


def _read_record(root: Path, path: Path, limit: int) -> bytes | None:
    """At most `limit` bytes of the record at `path`; None if there is none. Never follows
    a symlink, never reads anything but a regular file (_NotARecord)."""
    try:
        with _folder(root, path) as (folder, name):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                             dir_fd=folder)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise _NotARecord("a symlink") from None
                raise
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _NotARecord("not a regular file")
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _unlink_planted(root: Path, path: Path) -> None:
    """Remove what was planted at a record's place: the first symlinked level on its way
    (the link, never what it points to), else the entry itself."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        for part in path.relative_to(root).parts[:-1]:
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                _unlink_in(fd, part)
                return
            os.close(fd)
            fd = child
        _unlink_in(fd, path.name)
    finally:
        os.close(fd)


def _is_regular(root: Path, path: Path) -> bool:
    try:
        with _folder(root, path) as (folder, name):
            return stat.S_ISREG(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _write_atomic(root: Path, path: Path, data: bytes) -> None:
    """Write a temp file (created exclusively, 0600, never through a link), then rename it
    onto `path`: the rename replaces whatever entry was there, a planted symlink included."""
    with _folder(root, path, create=True) as (folder, name):
        tmp = f".{name}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                         0o600, dir_fd=folder)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            _unlink_in(folder, tmp)
            raise


def _touch(root: Path, path: Path) -> bool:
    """Mark a record used now. False if it does not exist."""
    try:
        with _folder(root, path) as (folder, name):
            os.utime(name, dir_fd=folder, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
    except OSError:
        return _is_regular(root, path)


def _unlink(root: Path, path: str | Path) -> int:
    """Delete the entry at `path` (never through a symlinked folder): 1, or 0 if gone."""
    try:
        with _folder(root, Path(path)) as (folder, name):
            return _unlink_in(folder, name)
    except FileNotFoundError:
        return 0
    except OSError as exc:
        log.warning("disk store: cannot delete %s: %s", path, exc)
        return 0


def _unlink_in(folder: int, name: str) -> int:
    try:
        os.unlink(name, dir_fd=folder)
        return 1
    except FileNotFoundError:
        return 0
    except OSError as exc:
        log.warning("disk store: cannot delete %s: %s", name, exc)
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

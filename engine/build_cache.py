"""A content-addressed cache of build outputs (converted models), safe across processes.

Layout under the root:

    <kind>-<key>/              one record; <key> hashes the inputs and the pdserve version
        metadata.json          written last: format version, kind, created time, inputs summary
        content/               what the build produced
    .tmp-<kind>-<key>-<rand>/  a record being built (renamed into place when complete)
    .trash-<rand>/             a record being removed
    .locks/<kind>-<key>.lock   one file lock per key

Invariants: a record directory appears only by an atomic rename of a complete temporary
sibling, so a crash leaves at worst a `.tmp-*` directory, which is never read and is removed
once nobody holds its key's lock. A record whose metadata.json is missing, unreadable or of
another format version is invalid: it is removed and rebuilt. The last use of a record is
the mtime of its metadata.json; pruning removes least recently used records first, never
the one just built.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from pdserve.common import envs, progress
from pdserve.common.errors import InvalidRequestError, PdserveError

log = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
_KIND_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
_HASH_CHUNK_BYTES = 8 << 20
_GB = 1024**3


class BuildCacheError(PdserveError):
    """The build cache could not produce a record (lock wait timed out, unusable root)."""


@dataclass(frozen=True, slots=True)
class BuildInputs:
    """What a build depends on: named strings, and named files hashed by their content.

    A file's path is not part of the key (the same bytes elsewhere hit the same record);
    it is kept in the record's metadata for people reading the cache.
    """

    values: tuple[tuple[str, str], ...] = ()
    files: tuple[tuple[str, Path], ...] = ()

    @classmethod
    def of(cls, values: Mapping[str, str] | None = None,
           files: Mapping[str, str | os.PathLike[str]] | None = None) -> BuildInputs:
        return cls(values=tuple(sorted((k, str(v)) for k, v in (values or {}).items())),
                   files=tuple(sorted((k, Path(v)) for k, v in (files or {}).items())))


@dataclass(frozen=True, slots=True)
class BuildResult:
    path: Path  # the record's content/ directory (or a temporary one when the cache is off)
    built: bool  # True when `build` ran in this call, False on a cache hit
    key: str  # the record's directory name


def pdserve_version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def hash_file(path: Path) -> str:
    """xxh3-128 of the file's bytes, read in chunks."""
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


class BuildCache:
    """Builds each distinct input set once and keeps the result, within record and size limits.

    Contract of `get_or_build`: returns a directory holding exactly what `build` wrote into
    the directory it was given, for these inputs; `build` runs at most once per key across
    all processes sharing the root (others wait on the key's lock), and not at all when a
    valid record exists. If `build` raises, nothing is recorded and the error propagates.
    With the cache disabled every call builds into a fresh temporary directory, removed at exit.
    """

    def __init__(self, root: Path, max_records: int, max_storage_gb: float, enabled: bool = True,
                 lock_timeout_s: float = 1800.0, seed: Path | None = None) -> None:
        """`seed`: a read-only cache (same layout) whose valid records are used in place,
        never written, touched or pruned: what an image prepared at build time."""
        if max_records < 1:
            raise InvalidRequestError(f"build cache max_records must be >= 1, got {max_records}")
        if not max_storage_gb > 0:
            raise InvalidRequestError(
                f"build cache max_storage_gb must be > 0, got {max_storage_gb}")
        self.root = Path(root).expanduser()
        self.max_records = max_records
        self.max_storage_bytes = int(max_storage_gb * _GB)
        self.enabled = enabled
        self.lock_timeout_s = lock_timeout_s
        self.seed = Path(seed).expanduser() if seed else None

    @classmethod
    def from_env(cls) -> BuildCache:
        try:
            max_records = int(envs.get("PDSERVE_CACHE_MAX_RECORDS"))
            max_storage_gb = float(envs.get("PDSERVE_CACHE_MAX_STORAGE_GB"))
        except ValueError as e:
            raise InvalidRequestError(f"bad PDSERVE_CACHE_* value: {e}") from e
        return cls(envs.cache_root(), max_records, max_storage_gb,
                   enabled=envs.get_bool("PDSERVE_CACHE_ENABLED"), seed=envs.get("PDSERVE_CACHE_SEED") or None)

    # ---- keys -------------------------------------------------------------------------

    def key_for(self, kind: str, inputs: BuildInputs) -> str:
        return self._key_and_summary(kind, inputs)[0]

    def _key_and_summary(self, kind: str, inputs: BuildInputs) -> tuple[str, dict]:
        import xxhash

        if not _KIND_RE.match(kind):
            raise InvalidRequestError(f"build kind {kind!r} must match {_KIND_RE.pattern}")
        files = {}
        for name, path in inputs.files:
            if not path.is_file():
                raise BuildCacheError(f"build input {name!r}: {path} is not a file")
            files[name] = {"path": str(path.resolve()), "size": path.stat().st_size,
                           "xxh3_128": hash_file(path)}
        keyed = {"format_version": CACHE_FORMAT_VERSION, "kind": kind,
                 "pdserve_version": pdserve_version(), "values": dict(inputs.values),
                 "files": {n: [f["xxh3_128"], f["size"]] for n, f in files.items()}}
        digest = xxhash.xxh3_128(json.dumps(keyed, sort_keys=True).encode()).hexdigest()
        summary = {"pdserve_version": keyed["pdserve_version"], "values": keyed["values"],
                   "files": files}
        return f"{kind}-{digest}", summary

    # ---- the one public operation -----------------------------------------------------

    def get_or_build(self, kind: str, inputs: BuildInputs, build: Callable[[Path], None],
                     description: str = "") -> BuildResult:
        key, summary = self._key_and_summary(kind, inputs)
        what = description or kind
        if not self.enabled:
            out = Path(tempfile.mkdtemp(prefix=f"pdserve-{kind}-"))
            atexit.register(shutil.rmtree, out, True)
            log.info("build cache off: building %s into %s", what, out)
            build(out)
            return BuildResult(out, built=True, key=key)

        record = self.root / key
        if self._is_valid(record, key):
            self._touch(record)
            return BuildResult(record / "content", built=False, key=key)
        if self.seed is not None and self._is_valid(self.seed / key, key):
            log.info("build cache: %s found prepared in %s", what, self.seed)
            return BuildResult(self.seed / key / "content", built=False, key=key)

        from filelock import FileLock, Timeout

        try:
            (self.root / ".locks").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise BuildCacheError(f"cannot use build cache root {self.root}: {e} "
                                  f"(set PDSERVE_CACHE_ROOT to a writable directory)") from e
        lock = FileLock(self._lock_path(key), timeout=self.lock_timeout_s)
        try:
            try:
                lock.acquire(timeout=0)
            except Timeout:  # another process builds it: say so while waiting
                with progress.step(f"waiting for another process building {what}"):
                    lock.acquire()
            try:
                built = self._build_locked(record, key, kind, summary, build, what)
            finally:
                lock.release()
        except Timeout as e:
            raise BuildCacheError(f"waited {self.lock_timeout_s:.0f} s for another process "
                                  f"building {what} ({key}); giving up") from e
        if built:
            self.prune(keep=key)
        else:
            self._touch(record)
        return BuildResult(record / "content", built=built, key=key)

    def _build_locked(self, record: Path, key: str, kind: str, summary: dict,
                      build: Callable[[Path], None], what: str) -> bool:
        if self._is_valid(record, key):  # another process built it while we waited
            return False
        if record.exists():
            log.warning("build cache: removing invalid record %s", record)
            self._remove(record)
        for stale in self.root.glob(f".tmp-{key}-*"):  # we hold the key: these are crash leftovers
            self._remove(stale)
        tmp = self.root / f".tmp-{key}-{uuid.uuid4().hex[:8]}"
        (tmp / "content").mkdir(parents=True)
        started = time.monotonic()
        log.info("build cache: building %s (record %s)", what, key)
        try:
            build(tmp / "content")
            meta = {"format_version": CACHE_FORMAT_VERSION, "kind": kind, "key": key,
                    "created": time.time(), "build_seconds": round(time.monotonic() - started, 3),
                    "inputs": summary}
            (tmp / "metadata.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
            os.rename(tmp, record)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("build cache: built %s in %.1f s", what, time.monotonic() - started)
        return True

    # ---- records ----------------------------------------------------------------------

    def records(self) -> list[Path]:
        """Valid records, least recently used first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir()
                 if p.is_dir() and not p.name.startswith(".") and self._is_valid(p, p.name)]
        return sorted(found, key=self._last_used)

    def prune(self, keep: str | None = None) -> list[str]:
        """Removes invalid records, stale temporaries, then least recently used records until
        both limits hold. Never removes `keep`. Returns the names removed."""
        removed = self._remove_garbage(keep)
        candidates = self.records()
        sizes = {p.name: _tree_bytes(p) for p in candidates}
        count, total = len(candidates), sum(sizes.values())
        for record in candidates:
            if count <= self.max_records and total <= self.max_storage_bytes:
                break
            if record.name == keep:
                continue
            self._remove(record)
            removed.append(record.name)
            count, total = count - 1, total - sizes[record.name]
        if total > self.max_storage_bytes:
            log.warning("build cache: %s alone exceeds max_storage_gb (%.3f GB > %.3f GB)",
                        keep, total / _GB, self.max_storage_bytes / _GB)
        if removed:
            log.info("build cache: pruned %s", ", ".join(removed))
        return removed

    def _remove_garbage(self, keep: str | None) -> list[str]:
        """Removes trash, and temporaries and invalid records whose key nobody holds."""
        from filelock import FileLock, Timeout

        removed: list[str] = []
        for entry in list(self.root.iterdir()) if self.root.is_dir() else []:
            if not entry.is_dir():
                continue
            if entry.name.startswith(".trash-"):  # a removal that was interrupted
                shutil.rmtree(entry, ignore_errors=True)
                continue
            key = _key_of_entry(entry.name)
            if key is None or key == keep:
                continue
            if not entry.name.startswith(".") and self._is_valid(entry, key):
                continue
            try:  # held: someone is building this key right now; its temporary is live
                with FileLock(self._lock_path(key), timeout=0):
                    self._remove(entry)
                    removed.append(entry.name)
            except Timeout:
                continue
        return removed

    def _is_valid(self, record: Path, key: str) -> bool:
        try:
            meta = json.loads((record / "metadata.json").read_text())
        except (OSError, ValueError):
            return False
        return (isinstance(meta, dict) and meta.get("format_version") == CACHE_FORMAT_VERSION
                and meta.get("key") == key and (record / "content").is_dir())

    def _lock_path(self, key: str) -> Path:
        return self.root / ".locks" / f"{key}.lock"

    @staticmethod
    def _last_used(record: Path) -> float:
        try:
            return (record / "metadata.json").stat().st_mtime
        except OSError:
            return 0.0

    @staticmethod
    def _touch(record: Path) -> None:
        try:
            os.utime(record / "metadata.json")
        except OSError:  # pruned by another process in between: the caller's path still reads
            pass

    def _remove(self, path: Path) -> None:
        # Rename first, so no reader ever sees a record half deleted.
        trash = self.root / f".trash-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(path, trash)
        except OSError:
            return
        shutil.rmtree(trash, ignore_errors=True)


_RECORD_NAME = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*-[0-9a-f]{32}")


def _key_of_entry(name: str) -> str | None:
    """The key that guards a cache entry: `<kind>-<32 hex>` or `.tmp-<key>-<rand>`; None for
    anything else under the root (the native kernels' builds in torch_extensions/, a
    benchmark's files), which pruning must leave alone."""
    key = name[len(".tmp-"):].rsplit("-", 1)[0] if name.startswith(".tmp-") else name
    return key if _RECORD_NAME.fullmatch(key) else None


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total

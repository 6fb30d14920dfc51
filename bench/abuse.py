"""A router under oversized prompts: `pdserve bench abuse --url http://127.0.0.1:8000 ...`.

What one careless or hostile client costs everyone else. Against a running deployment:
a small chat's latency alone (p50/p99), then again while `--clients` threads post
`--big-mb` MB prompts over HTTP in a loop and one thread sends a `--grpc-mb` MB prompt
over the router's gRPC port in a loop; then printed side by side with the ratio, what the
big requests got (status counts), how many workers the router counted alive before and
after, and, with `--router-pid`, the router's RSS before, at its peak, and after a settle.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import threading
import time
import urllib.error
import urllib.request


def rss_mb(pid: int) -> float:
    """Resident memory of process `pid` in MB (Linux /proc); 0 without a pid."""
    if not pid:
        return 0.0
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _post(url: str, body: bytes, timeout_s: float) -> int:
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code


def _health(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/health", timeout=30) as response:
        return json.loads(response.read())


def _small_chat_latencies(base: str, model: str, n: int, timeout_s: float) -> list[float]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}],
                       "max_tokens": 4, "temperature": 0}).encode()
    out = []
    for _ in range(n):
        start = time.perf_counter()
        status = _post(f"{base}/v1/chat/completions", body, timeout_s)
        out.append(time.perf_counter() - start if status == 200 else float("inf"))
    return out


def _percentiles(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


class Load:
    """The abusive clients; `statuses` counts what their requests got."""

    def __init__(self, base: str, grpc_address: str, model: str, clients: int, big_mb: float,
                 grpc_mb: float, timeout_s: float) -> None:
        self.stop = threading.Event()
        self.statuses: collections.Counter[str] = collections.Counter()
        self.peak_rss = 0.0
        big = json.dumps({"model": model, "prompt": "lorem ipsum " * int(big_mb * 2**20 / 12),
                          "max_tokens": 4}).encode()
        self.threads = [threading.Thread(target=self._http, args=(base, big, timeout_s), daemon=True)
                        for _ in range(clients)]
        if grpc_address and grpc_mb > 0:
            self.threads.append(threading.Thread(target=self._grpc, args=(grpc_address, model, grpc_mb, timeout_s),
                                                 daemon=True))

    def _http(self, base: str, body: bytes, timeout_s: float) -> None:
        while not self.stop.is_set():
            try:
                self.statuses[f"http {_post(f'{base}/v1/completions', body, timeout_s)}"] += 1
            except OSError:  # the router answered 413 and closed while the body was still going out
                self.statuses["http closed mid-upload"] += 1

    def _grpc(self, address: str, model: str, mb: float, timeout_s: float) -> None:
        import grpc

        from pdserve.proto.pdserve.v1 import generation_pb2, generation_pb2_grpc

        request = generation_pb2.GenerateRequest(model=model, prompt="x" * int(mb * 2**20))
        request.sampling.max_tokens = 4
        with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            while not self.stop.is_set():
                try:
                    list(stub.Generate(request, timeout=timeout_s))
                    self.statuses["grpc OK"] += 1
                except grpc.RpcError as exc:
                    self.statuses[f"grpc {exc.code().name}"] += 1

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench abuse", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the router's HTTP base URL")
    p.add_argument("--grpc", default="127.0.0.1:50050", help="the router's client gRPC address ('' for none)")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--clients", type=int, default=8, help="threads posting big prompts over HTTP")
    p.add_argument("--big-mb", type=float, default=4.0, help="size of each HTTP prompt")
    p.add_argument("--grpc-mb", type=float, default=50.0, help="size of the gRPC prompt (0: none)")
    p.add_argument("--chats", type=int, default=40, help="small chats per phase")
    p.add_argument("--router-pid", type=int, default=0, help="read the router's RSS from /proc")
    p.add_argument("--settle-s", type=float, default=10.0, help="wait after the load before the last RSS")
    p.add_argument("--timeout-s", type=float, default=120.0)
    args = p.parse_args(argv)
    base = args.url.rstrip("/")

    alive_before = _health(base)
    _small_chat_latencies(base, args.model, 3, args.timeout_s)  # warm
    rss_before = rss_mb(args.router_pid)
    alone = _small_chat_latencies(base, args.model, args.chats, args.timeout_s)
    with Load(base, args.grpc, args.model, args.clients, args.big_mb, args.grpc_mb, args.timeout_s) as load:
        sampler_stop = threading.Event()

        def sample_rss() -> None:
            while not sampler_stop.wait(0.2):
                load.peak_rss = max(load.peak_rss, rss_mb(args.router_pid))

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        loaded = _small_chat_latencies(base, args.model, args.chats, args.timeout_s)
        alive_during = _health(base)
        sampler_stop.set()
        sampler.join()
    time.sleep(args.settle_s)  # what the router gives back once the load is gone
    rss_after = rss_mb(args.router_pid)
    alive_after = _health(base)

    (p50a, p99a), (p50l, p99l) = _percentiles(alone), _percentiles(loaded)
    print(f"small chat, {args.chats} each: alone p50 {p50a * 1000:.0f} ms p99 {p99a * 1000:.0f} ms; "
          f"under load p50 {p50l * 1000:.0f} ms p99 {p99l * 1000:.0f} ms; p99 ratio {p99l / p99a:.2f}")
    print(f"load: {args.clients} x {args.big_mb:g} MB over HTTP, {args.grpc_mb:g} MB over gRPC: "
          + ", ".join(f"{k}: {v}" for k, v in sorted(load.statuses.items())))
    print("workers (decode/prefill) before {}/{}, during {}/{}, after {}/{}".format(
        alive_before["decode_workers"], alive_before["prefill_workers"], alive_during["decode_workers"],
        alive_during["prefill_workers"], alive_after["decode_workers"], alive_after["prefill_workers"]))
    if args.router_pid:
        print(f"router RSS: before {rss_before:.0f} MB, peak {load.peak_rss:.0f} MB (+{load.peak_rss - rss_before:.0f}), "
              f"after {args.settle_s:g} s {rss_after:.0f} MB (+{rss_after - rss_before:.0f})")
    return 0

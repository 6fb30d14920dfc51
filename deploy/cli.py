"""`pdserve` command line: `up`, `router`, `prefill`, `decode`, `bench`.

Every flag can also come from a YAML file (`--config`, keys = flag names with `_`) and from
`PDSERVE_<FLAG>` environment variables. Precedence: flag > environment > YAML > default.
Role mains are imported lazily so `pdserve router` never imports torch.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Sequence

# Default ports. Listeners bind to 127.0.0.1 unless --host says otherwise.
ROUTER_HTTP_PORT = 8000
ROUTER_GRPC_PORT = 50050
PREFILL_GRPC_PORT = 50060
DECODE_GRPC_PORT = 50070
TRANSFER_PORT = 50100
METRICS_PORT = 0  # 0: no separate metrics listener (the router serves /metrics on HTTP)

BACKENDS = ("ucx", "nccl", "redis", "disk")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file of flag values (keys are flag names with _)")
    p.add_argument("--host", help="address to bind listeners to (default 127.0.0.1)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR (default INFO)")
    p.add_argument("--metrics-port", type=int,
                   help="serve Prometheus /metrics on this port (0: off; default 0)")


def _add_engine(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", help="'default' (SmolLM2-135M-Instruct), a transformers dir, or a .gguf")
    g.add_argument("--served-model-name", help="name clients use in requests (default: from the model)")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    g.add_argument("--device", help="cpu or cuda[:N] (default cpu)")
    g.add_argument("--num-threads", type=int, help="torch intra-op threads")
    g.add_argument("--block-size", type=int, help="tokens per KV block (default 16)")
    g.add_argument("--max-kv-tokens", type=int, help="KV cache size in tokens")
    g.add_argument("--free-memory-fraction", type=float, help="share of free memory for the KV cache")
    g.add_argument("--max-num-tokens", type=int, help="tokens per engine step")
    g.add_argument("--max-batch-size", type=int, help="sequences per engine step")
    g.add_argument("--max-model-len", type=int, help="context length limit")
    g.add_argument("--capacity-policy",
                   choices=("GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH"))
    g.add_argument("--chunking-policy", choices=("FIRST_COME_FIRST_SERVED", "EQUAL_PROGRESS"))


def _add_worker(p: argparse.ArgumentParser, default_port: int) -> None:
    _add_engine(p)
    g = p.add_argument_group("worker")
    g.add_argument("--grpc-port", type=int, help=f"gRPC port (default {default_port}; 0 picks one)")
    g.add_argument("--advertise-host", help="address peers and the router use to reach this worker")
    g.add_argument("--router", help="router gRPC address host:port to register with (empty: none)")
    g.add_argument("--worker-id", help="stable id in the registry (default: host:port)")
    g.add_argument("--heartbeat-s", type=float,
                   help="heartbeat interval to the router (default 2; the router's ask caps it)")
    t = p.add_argument_group("kv transfer")
    t.add_argument("--kv-backends", help="fallback chain, comma separated (default ucx,nccl,redis,disk)")
    t.add_argument("--transfer-port", type=int, help=f"UCX/NCCL listener port (default {TRANSFER_PORT}; 0 picks)")
    t.add_argument("--redis-url", help="redis://host:port/db for the redis backend")
    t.add_argument("--disk-store", help="directory of the disk KV store (shared volume in k8s)")
    t.add_argument("--disk-store-max-gb", type=float, help="disk store size budget")
    t.add_argument("--transfer-timeout-s", type=float, help="deadline of one transfer step (default 10)")
    t.add_argument("--prefill-timeout-s", type=float,
                   help="decode: deadline of a remote prefill, from admission to the KV landing: the "
                        "prefill service's queue, compute and transfer (default 60); past it decode "
                        "follows --failure-policy")
    t.add_argument("--failure-policy", choices=("recompute", "fail"),
                   help="decode: what to do when the prefill leg fails (default recompute)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="router + prefill + decode on this machine")
    _add_common(up)
    _add_worker(up, PREFILL_GRPC_PORT)
    up.add_argument("--num-prefill", type=int, help="prefill services (default 1)")
    up.add_argument("--num-decode", type=int, help="decode services (default 1)")
    up.add_argument("--http-port", type=int, help=f"router HTTP port (default {ROUTER_HTTP_PORT})")
    up.add_argument("--router-grpc-port", type=int, help=f"router gRPC port (default {ROUTER_GRPC_PORT})")
    up.add_argument("--local-prefill", action="store_true", default=None,
                    help="decode prefills every prompt itself (no prefill service)")
    up.add_argument("--ready-timeout-s", type=float, help="how long to wait for all services (default 300)")

    router = sub.add_parser("router", help="the OpenAI HTTP + gRPC front")
    _add_common(router)
    router.add_argument("--http-port", type=int, help=f"HTTP port (default {ROUTER_HTTP_PORT})")
    router.add_argument("--grpc-port", type=int, help=f"gRPC port (default {ROUTER_GRPC_PORT})")
    router.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: none)")
    router.add_argument("--max-queue", type=int, help="requests in flight before 429 (default 256)")
    router.add_argument("--prefill-policy",
                        choices=("round_robin", "least_loaded", "prefix_aware", "session_affinity"))
    router.add_argument("--decode-policy",
                        choices=("round_robin", "least_loaded", "prefix_aware", "session_affinity"))
    router.add_argument("--local-prefill-threshold", type=int,
                        help="uncached prompt tokens at or under which decode prefills locally")
    router.add_argument("--max-body-bytes", type=int, help="largest request body (default 4 MiB)")
    router.add_argument("--worker-timeout-s", type=float, help="heartbeat age that marks a worker dead")
    router.add_argument("--static-workers",
                        help="comma list of role=host:port to use without registration")

    prefill = sub.add_parser("prefill", help="one prefill service")
    _add_common(prefill)
    _add_worker(prefill, PREFILL_GRPC_PORT)
    prefill.add_argument("--max-queue", type=int, help="queued prefills before refusing (default 64)")

    decode = sub.add_parser("decode", help="one decode service")
    _add_common(decode)
    _add_worker(decode, DECODE_GRPC_PORT)
    decode.add_argument("--local-prefill-threshold", type=int,
                        help="uncached prompt tokens at or under which to prefill locally (default 32)")
    decode.add_argument("--prefill-queue-threshold", type=int,
                        help="prefill queue length at or over which to prefill locally (default 8)")

    bench = sub.add_parser("bench", help="benchmarks: offline, transfer, serve, experiment")
    bench.add_argument("what", choices=("offline", "transfer", "serve", "experiment", "kernels"))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of that benchmark")
    return parser


def resolve(args: argparse.Namespace, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Merge YAML < PDSERVE_* environment < flags into one dict of settings."""
    from pdserve.engine import envs

    merged: dict[str, Any] = {}
    if getattr(args, "config", None):
        import yaml

        with open(args.config) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise SystemExit(f"pdserve: {args.config}: expected a mapping of flag names")
        merged.update({str(k).replace("-", "_"): v for k, v in data.items()})
    known = set(vars(args))
    types = _flag_types(getattr(args, "command", None))
    for key, value in envs.prefixed(environ).items():
        if key in known:
            convert = types.get(key)
            try:
                merged[key] = convert(value) if convert else value
            except ValueError:
                raise SystemExit(f"pdserve: PDSERVE_{key.upper()}={value!r} is not a valid value") from None
    merged.update({k: v for k, v in vars(args).items() if v is not None})
    unknown = sorted(set(merged) - known)
    if unknown:
        raise SystemExit(f"pdserve: unknown settings {unknown}")
    return merged


def _flag_types(command: str | None) -> dict[str, Callable[[str], Any]]:
    """dest -> converter for the flags of `command` (environment values arrive as text)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    role = sub.choices.get(command) if command else None
    out: dict[str, Callable[[str], Any]] = {}
    for action in (role._actions if role else ()):
        if action.type is not None:
            out[action.dest] = action.type
        elif action.const is True:
            out[action.dest] = lambda v: v.strip().lower() in ("1", "true", "yes", "on")
    return out


def _role_main(command: str) -> Callable[[dict[str, Any]], int]:
    if command == "up":
        from pdserve.deploy.up import main as fn
    elif command == "router":
        from pdserve.router.main import main as fn
    elif command == "prefill":
        from pdserve.prefill.main import main as fn
    elif command == "decode":
        from pdserve.decode.main import main as fn
    else:
        raise SystemExit(f"pdserve: unknown command {command}")
    return fn


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        from pdserve.bench.cli import main as bench_main

        return bench_main(args.what, args.rest)
    settings = resolve(args)
    return _role_main(args.command)(settings) or 0


if __name__ == "__main__":
    sys.exit(main())

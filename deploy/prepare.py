"""`pdserve prepare`: do once what every start of a worker would otherwise do first.

A worker's start converts a GGUF model into the build cache (about 20 s for the default
model on 2 cores) and, on CPU, compiles the native attention kernel for this CPU (about a
minute). Both land in the build cache (`PDSERVE_CACHE_ROOT`), so running this once per
image (the Dockerfile does, for the model it ships) or per cache volume (the chart's init
container does) takes them off every pod start. It prints what each step cost and what a
start now spends on it.
"""
from __future__ import annotations

import argparse
import time
from typing import Sequence


def add_parser(sub) -> None:
    p = sub.add_parser("prepare", help="convert the model and build the CPU kernel into the build cache, once",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct), a transformers dir, or a .gguf (default default)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]: the kernel is built for cpu only (default cpu)")
    p.add_argument("--skip-kernel", action="store_true",
                   help="model only (an image build: the kernel is built for the CPU it runs on)")


def main(args: argparse.Namespace) -> int:
    from pdserve.common.envs import cache_root
    from pdserve.common.errors import PdserveError
    from pdserve.engine.loader import load_model

    print(f"pdserve prepare: build cache {cache_root()}", flush=True)
    start = time.monotonic()
    try:
        loaded = load_model(args.model)
    except PdserveError as exc:
        print(f"pdserve prepare: {exc}", flush=True)
        return 1
    first = time.monotonic() - start
    start = time.monotonic()
    load_model(args.model)  # what a start costs now
    again = time.monotonic() - start
    done = "converted" if loaded.converted else "already prepared"
    print(f"model {loaded.name}: {done} in {first:.1f} s; a start now spends {again:.1f} s on it "
          f"({loaded.model_dir})", flush=True)
    if args.skip_kernel or not str(args.device).startswith("cpu"):
        return 0
    from pdserve.kernels import cpu_native

    start = time.monotonic()
    backend = cpu_native.backend_name()
    took = time.monotonic() - start
    if backend != "native":
        print(f"CPU attention kernel: not built ({took:.1f} s); workers use the torch path", flush=True)
        return 0 if cpu_native.mode() != "native" else 1
    print(f"CPU attention kernel: ready in {took:.1f} s (built for this CPU; a start with it "
          f"built loads it in well under a second)", flush=True)
    return 0


def run(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return main(parser.parse_args(["prepare", *argv]))

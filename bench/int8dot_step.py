"""A decode step's integer-dot linears against a streaming read of their bytes, in one process:
`pdserve bench int8dot-step`.

SmolLM2-135M's linears at `--rows` rows (30 layers of q/k/v, o, gate/up, down as Q4_1, and the
Q8_0 output projection: 96 MB, random blocks), run three ways in turn, `--rounds` times, the
median kept: the packed layout (`kernels.int8_dot.Int8DotLinear`, what `gguf-int8dot` runs),
the unpacked tiles (quantize_activations + int8dot_linear), and a float32 sum over as many
bytes (the read the step cannot beat). The ratios hold on a shared machine where absolute
times do not: each round runs all three back to back. PDSERVE_CPU_ISA picks a lower path.
"""
from __future__ import annotations

import argparse
import statistics
import time

from pdserve.bench.cli import HelpFormatter

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down
HEAD = (49152, 576)


def weights(layers: int, seed: int = 0):
    import torch

    from pdserve.kernels import quant

    g = torch.Generator().manual_seed(seed)

    def blocks(n: int, k: int, qtype: int) -> quant.QuantWeight:
        size = quant.BLOCK_BYTES[qtype]
        b = torch.randint(0, 256, (n, k // 32 * size), dtype=torch.uint8, generator=g)
        b.view(n, -1, size)[..., :2] = torch.tensor([0x00, 0x20], dtype=torch.uint8)  # d = 2^-7
        if qtype == quant.Q4_1:
            b.view(n, -1, size)[..., 2:4] = torch.tensor([0x00, 0xA0], dtype=torch.uint8)  # m = -2^-7
        return quant.QuantWeight(b, qtype)

    return [blocks(n, k, quant.Q4_1) for _ in range(layers) for n, k in SHAPES] + [blocks(*HEAD, quant.Q8_0)]


def measure(layers: int, rows: int, rounds: int) -> dict[str, float]:
    """Median seconds of one pass of each way over the step's linears."""
    import torch

    from pdserve.kernels import int8_dot

    linears = [int8_dot.Int8DotLinear.build(w) for w in weights(layers)]
    xs = {k: torch.randn(rows, k) for k in {w.in_features for w in linears}}
    reads = [torch.ones(lin.nbytes // 4) for lin in linears]
    ways = {
        "packed": lambda: [lin(xs[lin.in_features]) for lin in linears],
        "unpacked": lambda: [int8_dot.int8dot_linear(int8_dot.quantize_activations(xs[lin.in_features], lin.bits),
                                                     lin.weight) for lin in linears],
        "read": lambda: [r.sum() for r in reads],
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for name, way in ways.items():
        way()
    for _ in range(rounds):
        for name, way in ways.items():
            t0 = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench int8dot-step", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=31)
    p.add_argument("--layers", type=int, default=30)
    args = p.parse_args(argv)
    import torch

    from pdserve.kernels import int8_dot

    torch.set_num_threads(args.threads)
    total = sum(w.nbytes for w in weights(args.layers))
    print(f"CPU {int8_dot.cpu_model()}, path {int8_dot.chosen_isa()}, {args.threads} threads, "
          f"{total / 1e6:.1f} MB of weights, median of {args.rounds}", flush=True)
    for rows in args.rows:
        t = measure(args.layers, rows, args.rounds)
        print(f"rows {rows}: packed {t['packed'] * 1e3:.2f} ms, unpacked {t['unpacked'] * 1e3:.2f} ms, "
              f"read {t['read'] * 1e3:.2f} ms ({total / t['read'] / 1e9:.1f} GB/s); "
              f"packed/read {t['packed'] / t['read']:.2f}, unpacked/read {t['unpacked'] / t['read']:.2f}", flush=True)
    return 0

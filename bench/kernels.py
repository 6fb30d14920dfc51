"""Kernel benchmark: `python -m pdserve.bench.kernels [--device cpu|cuda] ...`.

On CUDA: paged decode attention (Triton) at batch 64 x context 4096, 32 query / 8 KV heads,
head dim 128, bf16, as achieved bandwidth and as a fraction of the device's peak (from a
table by device name, and of a measured device-to-device copy), beside torch's
scaled_dot_product_attention on the same K/V already gathered contiguous; then block
gather/scatter bandwidth beside a plain device copy.

On CPU: decode attention at SmolLM2's shape, batch 32 x context 320, 9 query / 3 KV heads,
head dim 64, through the native C++ kernel (what CPU serving runs when it builds) and the
pure-torch path; with `--only-decode` nothing else, otherwise also the loop-by-loop
reference and each one's share of a synthetic SmolLM2 decode step (random weights, same
matmul shapes, 30 layers).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

# Peak HBM bandwidth, bytes/s, by a substring of torch.cuda.get_device_name() (first match wins).
PEAK_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM5, "NVIDIA H100 80GB HBM3"
    ("H800", 3.35e12),
    ("B200", 8.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100-PCIE-80GB", 1.935e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
    ("L4", 0.3e12),
)

SMOLLM2 = dict(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, head_dim=64, vocab=49152)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--only-decode", action="store_true",
                        help="CPU: print only the decode paths' times")
    parser.add_argument("--iters", type=int, default=0, help="timed iterations (default: per benchmark)")
    parser.add_argument("--threads", type=int, default=0, help="CPU: torch threads (default: torch's)")
    parser.add_argument("--batch", type=int, default=64, help="CUDA decode: sequences")
    parser.add_argument("--context", type=int, default=4096, help="CUDA decode: tokens per sequence")
    parser.add_argument("--moved-blocks", type=int, default=1024, help="CUDA gather/scatter: blocks moved")
    args = parser.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda but CUDA is not available")
        _bench_cuda(torch.device("cuda"), args.iters or 50, args.batch, args.context, args.moved_blocks)
    else:
        if args.threads:
            torch.set_num_threads(args.threads)
        _bench_cpu(args.iters or 30, args.only_decode)
    return 0


# --- CPU -------------------------------------------------------------------------------

def _bench_cpu(iters: int, only_decode: bool) -> None:
    from pdserve.kernels import cpu_native, reference, synthetic, torch_paths

    m = SMOLLM2
    batch_size, context, block_size = 32, 320, 16
    # One cache per layer, as in serving: each layer's K/V is cold when its attention runs.
    layers = [synthetic.random_paged_batch([context] * batch_size, m["kv_heads"], m["head_dim"], block_size,
                                           seed=i) for i in range(m["layers"])]
    query = synthetic.random_queries(batch_size, m["heads"], m["head_dim"])
    new_kv = synthetic.random_queries(batch_size, m["kv_heads"], m["head_dim"], seed=2)
    scale = m["head_dim"] ** -0.5
    # The new token's K/V goes to each sequence's last slot (position context - 1).
    last = layers[0].context_lens.long() - 1
    slots = [b.block_tables.gather(1, (last // block_size)[:, None]).squeeze(1).long() * block_size
             + last % block_size for b in layers]
    native_op = cpu_native.decode_attention_op()

    def torch_attention(i: int) -> torch.Tensor:
        b = layers[i]
        return torch_paths.paged_decode_attention(query, b.kv_cache, b.block_tables, b.context_lens, scale)

    def native_attention(i: int) -> torch.Tensor:
        b = layers[i]
        return native_op((query * scale).contiguous(), b.kv_cache, b.block_tables, b.context_lens, 0)

    def reference_attention(i: int) -> torch.Tensor:
        b = layers[i]
        return reference.paged_decode_attention(query, b.kv_cache, b.block_tables, b.context_lens, scale)

    paths = [("native path", native_attention)] if native_op is not None else []
    paths.append(("torch path", torch_attention))
    per_layer_by_path = {}
    for name, attention in paths:
        step_s = _cpu_times(lambda: [attention(i) for i in range(m["layers"])], max(3, iters // 5))
        per_layer = per_layer_by_path[name] = [t / m["layers"] for t in step_s]
        print(f"cpu decode attention ({name}), SmolLM2 shape, batch {batch_size} x ctx {context}, "
              f"{torch.get_num_threads()} threads: median {_ms(per_layer)} / min {_ms(min(per_layer))} per layer, "
              f"{_ms(step_s)} per step ({m['layers']} layers)")
    if native_op is None:
        print(f"cpu decode attention (native path): unavailable, PDSERVE_CPU_ATTENTION={cpu_native.mode()}")
    else:
        ratio = statistics.median(per_layer_by_path["torch path"]) / statistics.median(per_layer_by_path["native path"])
        print(f"cpu decode attention: native path {ratio:.1f}x the torch path")
    if only_decode:
        return
    slow_s = _cpu_times(lambda: reference_attention(0), 2)
    print(f"cpu decode attention (reference): median {_ms(slow_s)} per layer "
          f"({statistics.median(slow_s) / statistics.median(per_layer_by_path['torch path']):.0f}x the torch path)")
    store = {"native path": torch_paths.store_kv, "torch path": torch_paths.store_kv, "reference": reference.store_kv}
    for name, attention in [*paths, ("reference", reference_attention)]:
        def layer(i: int, attention=attention, store_kv=store[name]) -> torch.Tensor:
            store_kv(new_kv, new_kv, layers[i].kv_cache, slots[i])
            return attention(i)

        step_s, attention_s = _synthetic_decode_step(batch_size, layer, repeats=1 if name == "reference" else 3)
        print(f"cpu synthetic SmolLM2 decode step with the {name}: {_ms(step_s)}, store_kv + attention "
              f"{_ms(attention_s)} = {attention_s / step_s:.0%} of the step")


def _synthetic_decode_step(batch_size: int, attend: Callable[[int], torch.Tensor], repeats: int
                           ) -> tuple[float, float]:
    """One decode step of a random-weight SmolLM2-shaped model: every matmul of the real one
    (qkv, o, gate/up, down per layer; lm_head), RMSNorms, and `attend(layer)` per layer.
    Returns (step seconds, attention seconds), best of `repeats`."""
    m = SMOLLM2
    gen = torch.Generator().manual_seed(0)
    q_kv = m["heads"] * m["head_dim"] + 2 * m["kv_heads"] * m["head_dim"]

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * 0.02

    layers = [(weight(m["hidden"], q_kv), weight(m["heads"] * m["head_dim"], m["hidden"]),
               weight(m["hidden"], 2 * m["intermediate"]), weight(m["intermediate"], m["hidden"]))
              for _ in range(m["layers"])]
    lm_head = weight(m["hidden"], m["vocab"])
    x0 = torch.randn(batch_size, m["hidden"], generator=gen)
    best = (float("inf"), 0.0)
    for _ in range(repeats):
        attention_s = 0.0
        start = time.perf_counter()
        x = x0
        for i, (w_qkv, w_o, w_gate_up, w_down) in enumerate(layers):
            h = torch.nn.functional.rms_norm(x, (m["hidden"],))
            h @ w_qkv  # q, k, v (their values do not matter here: `attend` has its own)
            t = time.perf_counter()
            attended = attend(i)  # stands for this layer's store_kv + attention over the paged cache
            attention_s += time.perf_counter() - t
            x = x + attended.reshape(batch_size, -1) @ w_o
            h = torch.nn.functional.rms_norm(x, (m["hidden"],))
            gate, up = (h @ w_gate_up).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ w_down
        logits = torch.nn.functional.rms_norm(x, (m["hidden"],)) @ lm_head
        logits.argmax(-1)
        step_s = time.perf_counter() - start
        if step_s < best[0]:
            best = (step_s, attention_s)
    return best


def _cpu_times(fn: Callable[[], object], iters: int) -> list[float]:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _ms(seconds: float | list[float]) -> str:
    if isinstance(seconds, list):
        seconds = statistics.median(seconds)
    return f"{seconds * 1e3:.2f} ms"


# --- CUDA ------------------------------------------------------------------------------

def _bench_cuda(device: torch.device, iters: int, batch_size: int, context: int, moved_blocks: int) -> None:
    name = torch.cuda.get_device_name(device)
    peak = next((bw for key, bw in PEAK_BANDWIDTH if key in name), None)
    copy_bw = _device_copy_bandwidth(device, iters)
    print(f"device: {name}; peak (table) {_tbs(peak)}; device copy (read+write) {_tbs(copy_bw)}")
    _bench_cuda_decode(device, iters, batch_size, context, peak, copy_bw)
    _bench_cuda_block_moves(device, iters, moved_blocks, copy_bw)


def _bench_cuda_decode(device: torch.device, iters: int, batch_size: int, context: int,
                       peak: float | None, copy_bw: float) -> None:
    from pdserve.kernels import synthetic, triton_attention

    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    batch = synthetic.random_paged_batch([context] * batch_size, kv_heads, head_dim, block_size,
                                         torch.bfloat16, device)
    query = synthetic.random_queries(batch_size, heads, head_dim, torch.bfloat16, device)
    scale = head_dim ** -0.5
    kv_bytes = batch_size * context * kv_heads * head_dim * 2 * 2  # K and V, bf16
    moved = kv_bytes + 2 * query.numel() * 2 + batch.block_tables.numel() * 4

    def triton_decode() -> torch.Tensor:
        return triton_attention.paged_decode_attention(query, batch.kv_cache, batch.block_tables,
                                                       batch.context_lens, scale)

    ms = _cuda_ms(triton_decode, iters)
    bw = moved / (ms * 1e-3)
    print(f"decode attention (triton, paged), batch {batch_size} x ctx {context}, {heads}/{kv_heads} heads, "
          f"d {head_dim}, bf16: {ms:.3f} ms, {_tbs(bw)} = {_share(bw, peak)} of peak, "
          f"{bw / copy_bw:.0%} of device copy")

    # torch SDPA on the same K/V, gathered once into contiguous [B, kvh, ctx, D] (not timed).
    ids = batch.block_tables[:, :-(-context // block_size)].long()
    k, v = (batch.kv_cache[ids, i].reshape(batch_size, -1, kv_heads, head_dim)[:, :context].transpose(1, 2)
            .contiguous() for i in (0, 1))
    q4 = query.unsqueeze(2)

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    sdpa_ms = _cuda_ms(sdpa, iters)
    sdpa_bw = moved / (sdpa_ms * 1e-3)
    diff = (sdpa().squeeze(2).float() - triton_decode().float()).abs().max().item()
    print(f"decode attention (torch SDPA, contiguous K/V): {sdpa_ms:.3f} ms, {_tbs(sdpa_bw)} = "
          f"{_share(sdpa_bw, peak)} of peak; triton/SDPA max abs diff {diff:.2e}")


def _bench_cuda_block_moves(device: torch.device, iters: int, moved_blocks: int, copy_bw: float) -> None:
    """32 layers of 4 x moved_blocks blocks, 64 KiB per block per layer (Llama-8B-like, bf16):
    1024 blocks moved is a 2 GiB buffer."""
    from pdserve.kernels import triton_block_copy

    num_layers, num_blocks = 32, 4 * moved_blocks
    layers = [torch.randn(num_blocks, 2, 16, 8, 128, device=device, dtype=torch.bfloat16)
              for _ in range(num_layers)]
    block_ids = torch.randperm(num_blocks, device=device)[:moved_blocks]
    buffer = torch.empty((moved_blocks, num_layers) + tuple(layers[0].shape[1:]), device=device,
                         dtype=torch.bfloat16)
    traffic = 2 * buffer.numel() * buffer.element_size()  # read + write
    gather_ms = _cuda_ms(lambda: triton_block_copy.gather_blocks(layers, block_ids, buffer), iters)
    scatter_ms = _cuda_ms(lambda: triton_block_copy.scatter_blocks(buffer, layers, block_ids), iters)
    for what, t in (("gather", gather_ms), ("scatter", scatter_ms)):
        bw = traffic / (t * 1e-3)
        print(f"block {what} ({moved_blocks} blocks x {num_layers} layers, "
              f"{buffer.numel() * 2 / 2**30:.2f} GiB): {t:.3f} ms, {_tbs(bw)} (read+write) = "
              f"{bw / copy_bw:.0%} of device copy")


def _device_copy_bandwidth(device: torch.device, iters: int) -> float:
    size = 2**30 if device.type == "cuda" else 2**24  # 1 GiB (a small one for a dry run on CPU)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _cuda_ms(lambda: dst.copy_(src), iters)
    return 2 * src.numel() / (ms * 1e-3)


def _cuda_ms(fn: Callable[[], object], iters: int) -> float:
    """Median milliseconds per call, by CUDA events, after warm-up (and compilation)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _tbs(bytes_per_s: float | None) -> str:
    return "unknown" if bytes_per_s is None else f"{bytes_per_s / 1e12:.2f} TB/s"


def _share(bw: float, peak: float | None) -> str:
    return "n/a" if peak is None else f"{bw / peak:.0%}"


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))

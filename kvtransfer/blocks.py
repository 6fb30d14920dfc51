"""Moving whole blocks between the paged cache and host transfer buffers.

Cache, per layer: `[num_blocks, 2, BS, H, D]`. Buffer: `[N, L, 2, BS, H, D]`, block-major,
so block i of a message is one contiguous run of `L * 2 * BS * H * D` elements (what the wire
format and the stores' single-block records expect). The copies themselves are
`pdserve.kernels.gather_blocks` / `scatter_blocks` (Triton on CUDA, torch on CPU); this
module adds the host side: ids as tensors, device <-> host, raw bytes <-> typed buffer.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import torch


def _ids(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
    return torch.as_tensor(list(block_ids), dtype=torch.int64).to(kv_caches[0].device)


def gather_to_host(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
    """A new contiguous CPU tensor `[N, L, 2, BS, H, D]` holding `block_ids` of every layer."""
    from pdserve.kernels import gather_blocks

    out = gather_blocks(kv_caches, _ids(kv_caches, block_ids))
    return out if out.device.type == "cpu" else out.cpu()


def gather_for_send(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], keep_on_device: bool
                    ) -> tuple[torch.Tensor, object | None]:
    """`block_ids` of every layer `[N, L, 2, BS, H, D]`, to send. With `keep_on_device` (a
    device-direct transport) and the cache on a GPU: a new GPU tensor and a CUDA event
    recorded behind the gather, which the sending thread waits on before it reads the tensor
    (it may run on another stream). Otherwise a host tensor and None."""
    if not (keep_on_device and kv_caches[0].is_cuda):
        return gather_to_host(kv_caches, block_ids), None
    from pdserve.kernels import gather_blocks

    out = gather_blocks(kv_caches, _ids(kv_caches, block_ids))
    ready = torch.cuda.Event()
    ready.record()
    return out, ready


def scatter_from_host(buffer: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                      block_ids: Sequence[int]) -> None:
    """Write `buffer` `[N, L, 2, BS, H, D]` (any device) into `block_ids` of every layer."""
    from pdserve.kernels import scatter_blocks

    device = kv_caches[0].device
    buffer = buffer.to(device, non_blocking=False).contiguous()
    scatter_blocks(buffer, kv_caches, _ids(kv_caches, block_ids))


def buffer_from_bytes(payload: memoryview | torch.Tensor, num_blocks: int, kv_caches: Sequence[torch.Tensor]
                      ) -> torch.Tensor:
    """View raw payload bytes (host bytes, or a uint8 tensor on any device) as the
    `[N, L, 2, BS, H, D]` buffer of these caches, without copying. The result is only read
    (scatter), so a read-only buffer is fine."""
    cache = kv_caches[0]
    shape = (num_blocks, len(kv_caches), *cache.shape[1:])
    flat = payload.reshape(-1).view(torch.uint8) if isinstance(payload, torch.Tensor) else bytes_tensor(payload)
    return flat.view(cache.dtype).view(shape)


def bytes_tensor(payload: memoryview) -> torch.Tensor:
    """Host bytes as a flat uint8 tensor sharing their memory, to be read only (a read-only
    buffer is fine)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable"
        return torch.frombuffer(payload, dtype=torch.uint8)

"""The resident adapters' weights on the engine's device, stacked by slot so that one step
applies several adapters at once, and the per-step view the forward reads.

Per layer and fused linear (`GROUPS`: qkv, o_proj, gate_up, down) the stacks are

    a   [max_loras, N * R, in]   slice i's A in rows i*R .. (i+1)*R, zero-padded past its rank
    b_i [max_loras, n_i, R]      slice i's B times the adapter's scaling, zero-padded columns

(R = max_lora_rank, N = the linear's slices). A slot holds one adapter or zeros; a module
the adapter does not target stays zero and adds nothing. Which path applies them is decided
once, from the device, the dtype and the native build (`path`):

- ``native`` (CPU, float32, the native kernels built): one call per linear whatever the mix
  of adapters (`kernels.lora.add_lora_native`); B is kept as `bt [max_loras, R, out]`, the
  slices side by side and transposed, and `ranks [max_loras]` per linear (0: not adapted);
- ``triton`` (CUDA, or the interpreter when forced): `kernels.lora.add_lora`'s kernels;
- ``torch``: `add_lora`'s grouped GEMMs, and for decode-sized steps each B also kept as one
  block matrix `b_full [max_loras * N * R, out]` (`add_lora_dense`): three ops per linear.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.lora.adapter import LoraAdapter, module_shapes
from pdserve.kernels import cpu_native
from pdserve.kernels.dispatch import use_triton
from pdserve.kernels.lora import add_lora, add_lora_dense, add_lora_native, dense_row_mask, runs

# steps of at most this many rows take the dense torch path (`add_lora_dense`): its
# arithmetic grows with the slots, its op count does not
DENSE_MAX_ROWS = 64

# the forward's fused linears and the PEFT modules stacked in each, in output order
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",),
}


def choose_path(device: torch.device, dtype: torch.dtype) -> str:
    """``triton``, ``native`` or ``torch`` for slots on `device` in `dtype` (see the module doc)."""
    if use_triton(device):
        return "triton"
    if device.type == "cpu" and dtype == torch.float32 and cpu_native.lora_op() is not None:
        return "native"
    return "torch"


class SlotWeights:
    """The device stacks of `num_slots` adapters (engine thread)."""

    def __init__(self, model_config: ModelConfig, num_slots: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype, path: str | None = None) -> None:
        """`path`: ``native``, ``triton`` or ``torch`` (None: `choose_path`'s)."""
        shapes = module_shapes(model_config)
        self.num_slots, self.rank, self.dtype = num_slots, max_rank, dtype
        self.device = device
        self.path = path or choose_path(device, dtype)
        self.op = cpu_native.lora_op() if self.path == "native" else None
        if self.path == "native" and self.op is None:
            raise RuntimeError("the native LoRA path needs the native CPU kernels (PDSERVE_CPU_ATTENTION)")
        # each group's slice column offsets in its output: 0, n_0, n_0 + n_1, ..., out
        self.bounds = {g: [sum(shapes[m][1] for m in mods[:i]) for i in range(len(mods) + 1)]
                       for g, mods in GROUPS.items()}
        zeros = dict(device=device, dtype=dtype)
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, list[torch.Tensor]]] = []  # empty on the native path
        self.b_full: list[dict[str, torch.Tensor]] = []  # the torch path's only
        self.bt: list[dict[str, torch.Tensor]] = []  # the native path's only
        self.ranks: list[dict[str, torch.Tensor]] = []  # the native path's only
        for _ in range(model_config.num_layers):
            self.a.append({g: torch.zeros(num_slots, len(mods) * max_rank, shapes[mods[0]][0], **zeros)
                           for g, mods in GROUPS.items()})
            if self.path == "native":
                self.bt.append({g: torch.zeros(num_slots, max_rank, self.bounds[g][-1], **zeros) for g in GROUPS})
                self.ranks.append({g: torch.zeros(num_slots, dtype=torch.int32) for g in GROUPS})
                continue
            self.b.append({g: [torch.zeros(num_slots, shapes[m][1], max_rank, **zeros) for m in mods]
                           for g, mods in GROUPS.items()})
            if self.path == "torch":
                self.b_full.append({g: torch.zeros(num_slots * len(mods) * max_rank, self.bounds[g][-1], **zeros)
                                    for g, mods in GROUPS.items()})
        # (layer, group) pairs each slot's adapter adapts: the others are skipped
        self.adapted: list[frozenset[tuple[int, str]]] = [frozenset()] * num_slots

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` in `slot`, replacing what was there."""
        adapted = set()
        for layer in range(len(self.a)):
            for group, mods in GROUPS.items():
                self.a[layer][group][slot].zero_()
                for i, module in enumerate(mods):
                    pair = adapter.weights.get((layer, module))
                    a, b = pair if pair is not None else (None, None)
                    if a is not None:
                        r = a.shape[0]
                        self.a[layer][group][slot, i * self.rank:i * self.rank + r] = a.to(self.dtype)
                        adapted.add((layer, group))
                    self._write_b(layer, group, i, slot, None if b is None else b * adapter.scaling)
                if self.path == "native":
                    self.ranks[layer][group][slot] = adapter.rank if (layer, group) in adapted else 0
                if self.b_full:
                    self._write_full(layer, group, slot)
        self.adapted[slot] = frozenset(adapted)

    def _write_b(self, layer: int, group: str, i: int, slot: int, b: torch.Tensor | None) -> None:
        """Slice i's scaled B [n_i, r] (None: zeros) in `slot`, in this path's layout."""
        if self.path == "native":
            lo, hi = self.bounds[group][i], self.bounds[group][i + 1]
            cols = self.bt[layer][group][slot, :, lo:hi]
            cols.zero_()
            if b is not None:
                cols[:b.shape[1]] = b.T.to(self.dtype)
            return
        rows = self.b[layer][group][i][slot]
        rows.zero_()
        if b is not None:
            rows[:, :b.shape[1]] = b.to(self.dtype)

    def _write_full(self, layer: int, group: str, slot: int) -> None:
        """b_full's rows of `slot`: slice i's B transposed, in its rows and its columns only."""
        full, k = self.b_full[layer][group], len(GROUPS[group]) * self.rank
        rows = full[slot * k:(slot + 1) * k]
        rows.zero_()
        off = 0
        for i, b in enumerate(self.b[layer][group]):
            n = b.shape[1]
            rows[i * self.rank:(i + 1) * self.rank, off:off + n] = b[slot].T
            off += n

    def batch(self, row_slots: list[int], device: torch.device) -> "NoLora":
        """A step's view: row t of the step runs under slot `row_slots[t]` (-1: none)."""
        groups = runs(row_slots)
        if not groups:
            return NO_LORA
        slots = torch.tensor(row_slots, dtype=torch.int32, device=device)
        if self.path == "native":
            active = frozenset().union(*(self.adapted[s] for s in {g[0] for g in groups}))
            return NativeLoraBatch(self, slots, active)
        dense = self.path == "torch" and len(row_slots) <= DENSE_MAX_ROWS
        return LoraBatch(self, slots, tuple(groups), {} if dense else None)


class NoLora:
    """A step with no adapter: the base model's outputs, untouched."""

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y


NO_LORA = NoLora()


@dataclass(frozen=True, slots=True)
class LoraBatch(NoLora):
    """A step's view on the triton and torch paths."""

    weights: SlotWeights
    slots: torch.Tensor  # [T] int32, each row's slot (-1: none)
    groups: tuple[tuple[int, int, int], ...]  # runs of equal slot >= 0: (slot, first row, end row)
    masks: dict[int, torch.Tensor] | None  # the dense path's row masks by width (None: not dense)

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base linear's output for input `x`) plus each row's adapter update."""
        w = self.weights
        runs_here = tuple(g for g in self.groups if (layer, group) in w.adapted[g[0]])
        if not runs_here:
            return y
        a = w.a[layer][group]
        if self.masks is None:
            return add_lora(y, x, a, w.b[layer][group], self.slots, runs_here)
        mask = self.masks.get(a.shape[1])
        if mask is None:
            mask = self.masks[a.shape[1]] = dense_row_mask(self.slots, w.num_slots, a.shape[1], a.dtype)
        return add_lora_dense(y, x, a, w.b_full[layer][group], mask)


@dataclass(frozen=True, slots=True)
class NativeLoraBatch(NoLora):
    """A step's view on the native path: one call per adapted linear."""

    weights: SlotWeights
    slots: torch.Tensor  # [T] int32, each row's slot (-1: none)
    active: frozenset[tuple[int, str]]  # (layer, group) pairs some row's adapter adapts

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base linear's output for input `x`) plus each row's adapter update."""
        if (layer, group) not in self.active:
            return y
        w = self.weights
        return add_lora_native(w.op, y, x, self.slots, w.ranks[layer][group], w.a[layer][group],
                               w.bt[layer][group], w.bounds[group])

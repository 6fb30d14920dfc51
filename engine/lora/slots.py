"""The resident adapters' weights on the engine's device, stacked by slot so that one step
applies several adapters at once, and the per-step view the forward reads.

Per layer and fused linear (`GROUPS`: qkv, o_proj, gate_up, down) the stacks are

    a   [max_loras, N * R, in]   slice i's A in rows i*R .. (i+1)*R, zero-padded past its rank
    b_i [max_loras, n_i, R]      slice i's B times the adapter's scaling, zero-padded columns

(R = max_lora_rank, N = the linear's slices). A slot holds one adapter or zeros; a module
the adapter does not target stays zero and adds nothing. For decode-sized steps on the
torch path each B is also kept as one block matrix `b_full [max_loras * N * R, out]`
(`kernels.lora.add_lora_dense`): three ops per linear whatever the mix of adapters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.lora.adapter import LoraAdapter, module_shapes
from pdserve.kernels.dispatch import use_triton
from pdserve.kernels.lora import add_lora, add_lora_dense, dense_row_mask, runs

# steps of at most this many rows take the dense torch path (`add_lora_dense`): its
# arithmetic grows with the slots, its op count does not
DENSE_MAX_ROWS = 64

# the forward's fused linears and the PEFT modules stacked in each, in output order
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",),
}


class SlotWeights:
    """The device stacks of `num_slots` adapters (engine thread)."""

    def __init__(self, model_config: ModelConfig, num_slots: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        shapes = module_shapes(model_config)
        self.num_slots, self.rank, self.dtype = num_slots, max_rank, dtype
        self.device = device
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, list[torch.Tensor]]] = []
        self.b_full: list[dict[str, torch.Tensor]] = []  # empty where the Triton path runs
        self.dense = dense = not use_triton(device)
        for _ in range(model_config.num_layers):
            self.a.append({g: torch.zeros(num_slots, len(mods) * max_rank, shapes[mods[0]][0], device=device,
                                          dtype=dtype) for g, mods in GROUPS.items()})
            self.b.append({g: [torch.zeros(num_slots, shapes[m][1], max_rank, device=device, dtype=dtype)
                               for m in mods] for g, mods in GROUPS.items()})
            if dense:
                self.b_full.append({g: torch.zeros(num_slots * len(mods) * max_rank,
                                                   sum(shapes[m][1] for m in mods), device=device, dtype=dtype)
                                    for g, mods in GROUPS.items()})
        # (layer, group) pairs each slot's adapter adapts: the torch path skips the others
        self.adapted: list[frozenset[tuple[int, str]]] = [frozenset()] * num_slots

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` in `slot`, replacing what was there."""
        adapted = set()
        for layer, (a_stacks, b_stacks) in enumerate(zip(self.a, self.b)):
            for group, mods in GROUPS.items():
                a_stacks[group][slot].zero_()
                for i, module in enumerate(mods):
                    b_stacks[group][i][slot].zero_()
                    pair = adapter.weights.get((layer, module))
                    if pair is not None:
                        a, b = pair
                        r = a.shape[0]
                        a_stacks[group][slot, i * self.rank:i * self.rank + r] = a.to(self.dtype)
                        b_stacks[group][i][slot, :, :r] = (b * adapter.scaling).to(self.dtype)
                        adapted.add((layer, group))
                if self.b_full:
                    self._write_full(layer, group, slot)
        self.adapted[slot] = frozenset(adapted)

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

    def batch(self, row_slots: list[int], device: torch.device) -> "LoraBatch":
        """A step's view: row t of the step runs under slot `row_slots[t]` (-1: none)."""
        groups = runs(row_slots)
        if not groups:
            return NO_LORA
        slots = torch.tensor(row_slots, dtype=torch.int32, device=device)
        dense = self.dense and len(row_slots) <= DENSE_MAX_ROWS
        return LoraBatch(self, slots, tuple(groups), {} if dense else None)


class NoLora:
    """A step with no adapter: the base model's outputs, untouched."""

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y


NO_LORA = NoLora()


@dataclass(frozen=True, slots=True)
class LoraBatch(NoLora):
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

"""The resident adapters' weights on the engine's device, stacked by slot so that one step
applies several adapters at once, and the per-step view the forward reads.

Per layer and fused linear (`GROUPS`: qkv, o_proj, gate_up, down) the stacks are

    a   [max_loras, N * R, in]   slice i's A in rows i*R .. (i+1)*R, zero-padded past its rank
    b_i [max_loras, n_i, R]      slice i's B times the adapter's scaling, zero-padded columns

(R = max_lora_rank, N = the linear's slices). A slot holds one adapter or zeros; a module
the adapter does not target stays zero and adds nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.lora.adapter import LoraAdapter, module_shapes
from pdserve.kernels.lora import add_lora, runs

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
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, list[torch.Tensor]]] = []
        for _ in range(model_config.num_layers):
            self.a.append({g: torch.zeros(num_slots, len(mods) * max_rank, shapes[mods[0]][0], device=device,
                                          dtype=dtype) for g, mods in GROUPS.items()})
            self.b.append({g: [torch.zeros(num_slots, shapes[m][1], max_rank, device=device, dtype=dtype)
                               for m in mods] for g, mods in GROUPS.items()})
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
                    if pair is None:
                        continue
                    a, b = pair
                    r = a.shape[0]
                    a_stacks[group][slot, i * self.rank:i * self.rank + r] = a.to(self.dtype)
                    b_stacks[group][i][slot, :, :r] = (b * adapter.scaling).to(self.dtype)
                    adapted.add((layer, group))
        self.adapted[slot] = frozenset(adapted)

    def batch(self, row_slots: list[int], device: torch.device) -> "LoraBatch":
        """A step's view: row t of the step runs under slot `row_slots[t]` (-1: none)."""
        groups = runs(row_slots)
        if not groups:
            return NO_LORA
        return LoraBatch(self, torch.tensor(row_slots, dtype=torch.int32, device=device), tuple(groups))


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

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base linear's output for input `x`) plus each row's adapter update."""
        w = self.weights
        runs_here = tuple(g for g in self.groups if (layer, group) in w.adapted[g[0]])
        if runs_here:
            add_lora(y, x, w.a[layer][group], w.b[layer][group], self.slots, runs_here)
        return y

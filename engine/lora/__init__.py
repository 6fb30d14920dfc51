"""LoRA adapters inside the engine: PEFT adapters read and checked (`adapter`), held in
memory and in device slots (`manager`), applied per token row in a batched step (`slots`,
`kernels.lora`)."""
from pdserve.engine.lora.adapter import TARGET_MODULES, LoraAdapter, load_peft_adapter
from pdserve.engine.lora.manager import NO_LORAS, LoraManager, NoLoras
from pdserve.engine.lora.slots import NO_LORA, LoraBatch, NoLora

__all__ = ["NO_LORA", "NO_LORAS", "TARGET_MODULES", "LoraAdapter", "LoraBatch", "LoraManager", "NoLora",
           "NoLoras", "load_peft_adapter"]

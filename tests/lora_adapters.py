"""PEFT-format LoRA adapters made in tests, and transformers references that apply them.

`write_adapter` writes what PEFT's `save_pretrained` writes for a LoRA on a Llama-family
model (`adapter_config.json`, `adapter_model.safetensors` with PEFT's tensor names), with
random non-zero A and B. `merged_reference` is a transformers model whose adapted weights
are W + scaling * B @ A: the function PEFT's LoRA layers compute.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _module_prefix(module: str) -> str:
    return "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def write_adapter(path: Path, model_dir: Path, *, targets=ALL_TARGETS, rank: int = 4, alpha: float = 8.0,
                  seed: int = 0, std: float = 0.1, use_rslora: bool = False) -> Path:
    """A random LoRA for the transformers model in `model_dir`, saved in PEFT's format."""
    from safetensors.torch import load_file, save_file

    base = {}
    for file in Path(model_dir).glob("*.safetensors"):
        base.update(load_file(str(file)))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in targets:
            name = f"model.layers.{layer}.{_module_prefix(module)}.{module}"
            out_f, in_f = base[name + ".weight"].shape
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * std
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * std
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": use_rslora,
        "use_dora": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
        "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir)}))
    return path


def merged_reference(model_dir: Path, adapter_dir: Path | None):
    """transformers' model of `model_dir` with the adapter merged in (None: the base model)."""
    import transformers
    from safetensors.torch import load_file

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    if adapter_dir is None:
        return model
    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    r, alpha = config["r"], config["lora_alpha"]
    scaling = alpha / r ** 0.5 if config.get("use_rslora") else alpha / r
    tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            name = key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
            params[name] += scaling * (b.double() @ a.double()).float()
    return model


def greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()

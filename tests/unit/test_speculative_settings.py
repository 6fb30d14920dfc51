"""--speculative-config from flag, environment and YAML to the engine's config; `up` passes
it to its workers; a malformed one is refused at start with the reason."""
from __future__ import annotations

import pytest

from pdserve.deploy import up
from pdserve.deploy.cli import build_parser, resolve
from pdserve.worker.settings import SettingsError, WorkerSettings

NGRAM = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}'


def test_speculative_config_reaches_the_decode_engine(tmp_path):
    flag = resolve(build_parser().parse_args(["decode", "--speculative-config", NGRAM]), environ={})
    spec = WorkerSettings.from_settings("decode", flag).engine_config().speculative
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == (5, 3, 2)
    env = resolve(build_parser().parse_args(["decode"]), environ={"PDSERVE_SPECULATIVE_CONFIG": NGRAM})
    assert WorkerSettings.from_settings("decode", env).engine_config().speculative == spec
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"speculative_config: '{NGRAM}'\n")
    yaml = resolve(build_parser().parse_args(["decode", "--config", str(cfg)]), environ={})
    assert WorkerSettings.from_settings("decode", yaml).engine_config().speculative == spec
    unset = resolve(build_parser().parse_args(["decode"]), environ={})
    assert WorkerSettings.from_settings("decode", unset).engine_config().speculative is None


def test_up_passes_it_to_its_workers():
    settings = resolve(build_parser().parse_args(["up", "--speculative-config", NGRAM]), environ={})
    children, _ = up.plan(dict(settings, cluster_secret_file="/s"))
    decodes = [c for c in children if c.name.startswith("decode")]
    assert decodes and all(NGRAM in c.argv for c in decodes)


@pytest.mark.parametrize("value, reason", [('{"method": "ngram"}', "num_speculative_tokens"),
                                           ('{"num_speculative_tokens": 4, "model": "x"}', "unsupported keys"),
                                           ("ngram", "not JSON")])
def test_a_malformed_config_is_refused_at_start(value, reason):
    with pytest.raises(SettingsError, match=reason):
        WorkerSettings.from_settings("decode", {"speculative_config": value})

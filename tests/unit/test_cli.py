from pdserve.deploy.cli import build_parser, resolve


def test_flags_override_env_override_yaml(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_batch_size: 4\nblock_size: 32\nmodel: from-yaml\n")
    args = build_parser().parse_args(["decode", "--config", str(cfg), "--max-batch-size", "8"])
    settings = resolve(args, environ={"PDSERVE_BLOCK_SIZE": "16", "PDSERVE_UNRELATED_THING": "x"})
    assert settings["max_batch_size"] == 8  # flag wins
    assert settings["block_size"] == 16  # env beats YAML, typed like the flag
    assert settings["model"] == "from-yaml"


def test_unknown_yaml_key_is_rejected(tmp_path):
    import pytest

    cfg = tmp_path / "c.yaml"
    cfg.write_text("no_such_flag: 1\n")
    args = build_parser().parse_args(["router", "--config", str(cfg)])
    with pytest.raises(SystemExit, match="no_such_flag"):
        resolve(args, environ={})


def test_bad_env_value_is_a_clear_error():
    import pytest

    args = build_parser().parse_args(["decode"])
    with pytest.raises(SystemExit, match="PDSERVE_MAX_BATCH_SIZE"):
        resolve(args, environ={"PDSERVE_MAX_BATCH_SIZE": "many"})

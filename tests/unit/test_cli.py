from pdserve.deploy import cli
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


def _dests(command: str) -> set[str]:
    import argparse

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest for a in sub.choices[command]._actions if a.dest != "help"}


def test_up_takes_only_flags_it_uses():
    from dataclasses import fields

    from pdserve.deploy import up
    from pdserve.planner.settings import PlannerSettings

    planner = {f.name for f in fields(PlannerSettings) if "up" in f.metadata["roles"]}  # `up` runs the planner
    own = {"config", "host", "log_level", "num_prefill", "num_decode", "http_port", "router_grpc_port",
           "router_registry_port", "internal_host",
           "local_prefill", "ready_timeout_s", "max_restarts", "api_key", *up.SECURITY_FLAGS, *planner}
    from pdserve.deploy.cli import router_pass_through, worker_pass_through

    assert _dests("up") - own == (set(worker_pass_through()) | set(router_pass_through())) - {"log_level"}
    # every engine and transfer flag of a worker reaches the workers `up` starts (core_share,
    # burst_threads and each worker's enrollment_token: `up` sets them itself)
    assert _dests("decode") - {"metrics_port", "metrics_token", "metrics_token_file", "grpc_port", "advertise_host", "router", "worker_id",
                               "transfer_port", "burst_threads", "core_share",
                               "enrollment_token", "enrollment_token_file"} - own <= set(worker_pass_through())
    assert "attention_window" in worker_pass_through() and "lenient_json_schema" in router_pass_through()


def _help_defaults(command: str) -> dict[str, str]:
    """dest -> the default a flag's help text claims, for one subcommand."""
    import argparse
    import re

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for action in sub.choices[command]._actions:
        found = re.search(r"\(default ([^)]*)\)$", action.help or "")
        if found:
            out[action.dest] = found.group(1)
    return out


def test_help_defaults_are_the_settings_real_defaults():
    """What `--help` says a flag defaults to is what the service runs with when it is unset."""
    from pdserve.router.config import RouterConfig
    from pdserve.worker.settings import WorkerSettings

    def shown(value):
        return "none" if value in ("", None, ()) else str(value)

    for role in ("prefill", "decode"):
        claimed = _help_defaults(role)
        real = WorkerSettings.from_settings(role, {})
        assert len(claimed) >= 25, sorted(claimed)
        for dest, text in claimed.items():
            assert text == shown(getattr(real, dest)), (role, dest, text)
    assert (WorkerSettings.from_settings("prefill", {}).grpc_port,
            WorkerSettings.from_settings("decode", {}).grpc_port) == (50060, 50070)
    router = RouterConfig.from_settings({})
    for dest, text in _help_defaults("router").items():
        assert text == shown(getattr(router, dest)), ("router", dest, text)
    assert set(_help_defaults("router")) >= {"http_port", "grpc_port", "max_queue", "decode_policy",
                                             "local_prefill_threshold", "prefill_queue_threshold"}


def test_up_makes_a_private_cluster_secret_per_run_and_removes_it(tmp_path):
    import os
    import stat

    from pdserve.security.secret import ClusterSecret
    from pdserve.deploy import up

    with up.cluster_secret({"num_decode": 1}) as settings:
        path = settings["cluster_secret_file"]
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        ClusterSecret.load(path)
        children, _ = up.plan(settings)
        for child in children:  # every process gets the same file, never the secret itself
            assert child.argv[child.argv.index("--cluster-secret-file") + 1] == path
            assert open(path).read().strip() not in " ".join(child.argv)
    assert not os.path.exists(path)
    given = str(tmp_path / "mine")
    ClusterSecret.create(given)
    with up.cluster_secret({"cluster_secret_file": given}) as settings:
        assert settings["cluster_secret_file"] == given
    assert os.path.exists(given)


def test_up_keeps_its_secret_across_runs_when_it_has_a_prefix_store(tmp_path, monkeypatch):
    """With a prefix store, the store's keys derive from the cluster secret: `up` keeps the one
    it made (0600 in a 0700 folder of its cache root) so that its next run finds the store."""
    import os
    import stat

    import pytest

    from pdserve.security.secret import ClusterSecret
    from pdserve.deploy import up

    monkeypatch.setenv("PDSERVE_CACHE_ROOT", str(tmp_path / "cache"))
    with up.cluster_secret({"prefix_store": "disk"}) as settings:
        first = settings["cluster_secret_file"]
        material = open(first).read()
    assert first == str(tmp_path / "cache" / "up" / "cluster-secret")
    assert stat.S_IMODE(os.stat(first).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(first)).st_mode) == 0o700
    with up.cluster_secret({"prefix_store": "disk"}) as settings:
        assert settings["cluster_secret_file"] == first and open(first).read() == material
    ClusterSecret.load(first)
    os.chmod(first, 0o644)  # readable by others: refused, not used
    with pytest.raises(Exception, match="cluster secret"):
        with up.cluster_secret({"prefix_store": "disk"}):
            pass


def test_prefix_store_is_validated_and_reaches_the_transfer_config(tmp_path):
    import pytest

    from pdserve.worker.settings import SettingsError, WorkerSettings

    for role in ("prefill", "decode"):
        args = build_parser().parse_args([role, "--prefix-store", "disk", "--disk-store", str(tmp_path)])
        settings = WorkerSettings.from_settings(role, resolve(args, environ={}))
        assert settings.transfer_config().prefix_cache == "disk"
    assert WorkerSettings.from_settings("decode", {}).transfer_config().prefix_cache is None
    with pytest.raises(SettingsError, match="--disk-store"):
        WorkerSettings.from_settings("prefill", {"prefix_store": "disk"})
    with pytest.raises(SettingsError, match="--redis-url"):
        WorkerSettings.from_settings("decode", {"prefix_store": "redis"})
    with pytest.raises(SettingsError, match="disk, redis or none"):
        WorkerSettings.from_settings("decode", {"prefix_store": "s3"})


def test_both_services_default_to_a_256_token_step_with_chunked_prefill():
    """A wave of prompts is prefilled in 256-token chunks with the decodes riding along (issue
    13's measured budget), unless a flag says otherwise."""
    from pdserve.worker.settings import WorkerSettings

    for role in ("prefill", "decode"):
        sched = WorkerSettings.from_settings(role, {}).engine_config().scheduler
        assert (sched.max_num_tokens, sched.enable_chunked_prefill) == (256, True), role
    args = build_parser().parse_args(["decode", "--max-num-tokens", "2048"])
    explicit = WorkerSettings.from_settings("decode", resolve(args, environ={}))
    assert explicit.engine_config().scheduler.max_num_tokens == 2048


def test_prepare_converts_once_and_says_what_a_start_now_costs(tmp_path, monkeypatch, capsys):
    """`pdserve prepare` on a GGUF: the first run converts into the build cache, the second
    finds it; both report the time. A model it cannot load is a clear failure (exit 1)."""
    from support import write_gguf

    from pdserve.engine import loader

    monkeypatch.setenv("PDSERVE_CACHE_ROOT", str(tmp_path / "cache"))
    runs = []  # the conversion itself (transformers' dequantisation) is the loader's tests' business
    monkeypatch.setattr(loader, "_gguf_to_dir", lambda gguf, out: runs.append(out) or _tiny_dir(out))
    gguf = write_gguf(tmp_path / "tiny-Q4_0.gguf")
    assert cli.main(["prepare", "--model", str(gguf), "--skip-kernel"]) == 0
    assert cli.main(["prepare", "--model", str(gguf), "--skip-kernel"]) == 0
    out = capsys.readouterr().out
    assert len(runs) == 1
    assert "model tiny: converted in" in out and "model tiny: already prepared in" in out
    assert "a start now spends" in out
    assert cli.main(["prepare", "--model", str(tmp_path / "missing.gguf"), "--skip-kernel"]) == 1
    assert "not found" in capsys.readouterr().out


def _tiny_dir(out):
    import transformers

    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)


def test_up_hands_every_router_option_to_its_router_from_flags_or_yaml(tmp_path):
    """Router options given to `up` (flags, --port, or YAML keys) reach the router it starts,
    parsed by the router's own parser into the same values; the API key travels in the
    environment, never in argv (visible to ps)."""
    from pdserve.deploy import up

    config = tmp_path / "up.yaml"
    config.write_text("decode_policy: round_robin\nlocal_prefill_threshold: 0\nmax_migrations: 1\n")
    args = build_parser().parse_args(["up", "--config", str(config), "--port", "8123", "--api-key", "k3y",
                                      "--stream-idle-timeout-s", "12", "--metrics-auth"])
    settings = resolve(args, environ={})
    children, http_port = up.plan(dict(settings, cluster_secret_file="/s"))
    router = children[0]
    assert router.name == "router" and http_port == 8123
    parsed = resolve(build_parser().parse_args(router.argv[3:]), environ={})
    assert parsed["http_port"] == 8123 and parsed["decode_policy"] == "round_robin"
    assert (parsed["local_prefill_threshold"], parsed["max_migrations"]) == (0, 1)
    assert (parsed["stream_idle_timeout_s"], parsed["metrics_auth"]) == (12.0, True)
    assert "k3y" not in " ".join(router.argv) and router.env == {"PDSERVE_API_KEY": "k3y"}
    assert all("--decode-policy" not in c.argv for c in children[1:])  # workers get worker flags only


def test_up_passes_the_redis_url_to_workers_in_their_environment_never_argv():
    """A Redis URL may carry a password: `up` hands it to its workers as PDSERVE_REDIS_URL."""
    from pdserve.deploy import up

    url = "redis://:s3cret-pw@127.0.0.1:6379/0"
    settings = resolve(build_parser().parse_args(["up", "--redis-url", url]), environ={})
    children, _ = up.plan(dict(settings, cluster_secret_file="/s"))
    for child in children:
        assert "s3cret-pw" not in " ".join(child.argv) and "--redis-url" not in child.argv
    for worker in children[1:]:
        assert set(worker.env) == {"PDSERVE_REDIS_URL", "PDSERVE_ENROLLMENT_TOKEN"}
        assert worker.env["PDSERVE_REDIS_URL"] == url
        assert resolve(build_parser().parse_args(worker.argv[3:]), environ=worker.env)["redis_url"] == url
    assert "PDSERVE_REDIS_URL" not in children[0].env  # the router has no use for it


def test_up_gives_each_worker_its_own_enrollment_token_and_the_router_only_its_public_key():
    from pdserve.deploy import up
    import pytest

    from pdserve.security.enrollment import EnrollmentError, EnrollmentVerifier

    settings = resolve(build_parser().parse_args(["up", "--num-decode", "2"]), environ={})
    children, _ = up.plan(dict(settings, cluster_secret_file="/s"))
    router = children[0].argv
    verifier = EnrollmentVerifier.from_hex(router[router.index("--enrollment-public-key") + 1])
    tokens = set()
    for worker in children[1:]:
        token = worker.env["PDSERVE_ENROLLMENT_TOKEN"]
        assert token not in " ".join(worker.argv) and token not in " ".join(router)
        parsed = resolve(build_parser().parse_args(worker.argv[3:]), environ=worker.env)
        assert parsed["enrollment_token"] == token
        worker_id, role = worker.name, worker.argv[3]
        verifier.check(token, worker_id, role, "127.0.0.1:1")
        with pytest.raises(EnrollmentError):
            verifier.check(token, "decode-rogue", role, "127.0.0.1:1")
        tokens.add(token)
    assert len(tokens) == len(children) - 1
    keyed, _ = up.plan(dict(settings, cluster_secret_file="/s", router_key_ring_file="/r", host="0.0.0.0"))
    assert keyed[0].argv[keyed[0].argv.index("--host") + 1] == "0.0.0.0"  # the client ports follow --host...
    assert keyed[0].argv[keyed[0].argv.index("--internal-host") + 1] == "127.0.0.1"  # ...the registry does not
    assert all(w.argv[w.argv.index("--host") + 1] == "127.0.0.1" for w in keyed[1:])  # nor do the workers
    assert keyed[0].argv[keyed[0].argv.index("--cluster-secret-file") + 1] == "/r"  # the router: its key ring
    assert all(w.argv[w.argv.index("--cluster-secret-file") + 1] == "/s" for w in keyed[1:])


def test_up_shares_the_kv_memory_fraction_among_its_workers():
    from pdserve.deploy import up

    def fractions(*argv):
        children, _ = up.plan(dict(resolve(build_parser().parse_args(["up", *argv]), environ={}),
                                   cluster_secret_file="/s"))
        return [resolve(build_parser().parse_args(c.argv[3:]), environ={})["free_memory_fraction"]
                for c in children[1:]]

    assert fractions("--num-decode", "2") == [0.3, 0.3, 0.3]  # 0.9 of what is available, in 3
    assert fractions("--free-memory-fraction", "0.5") == [0.5, 0.5]  # given: as given


def test_up_splits_the_cores_and_shares_them_when_it_picks_the_thread_counts(monkeypatch):
    """With the default thread count, each engine takes its share of the machine's cores and,
    through the run's core share, all of them while every other engine is idle."""
    from pdserve.deploy import up

    monkeypatch.setattr(up.os, "cpu_count", lambda: 8)

    def threads(*argv):
        settings = resolve(build_parser().parse_args(["up", *argv]), environ={})
        children, _ = up.plan(dict(settings, cluster_secret_file="/s", core_share="/run/share"))
        out = {}
        for child in children[1:]:
            parsed = resolve(build_parser().parse_args(child.argv[3:]), environ={})
            assert parsed.get("core_share", "") in ("", "/run/share")
            out[child.name] = (parsed["num_threads"], parsed.get("burst_threads", 0))
        return out

    assert threads() == {"prefill-0": (4, 8), "decode-0": (4, 8)}
    assert threads("--num-prefill", "2", "--num-decode", "2") == {
        "prefill-0": (2, 8), "prefill-1": (2, 8), "decode-0": (2, 8), "decode-1": (2, 8)}
    assert threads("--num-threads", "2") == {"prefill-0": (2, 0), "decode-0": (2, 0)}  # as given: no share
    assert threads("--local-prefill") == {"decode-0": (8, 0)}  # one engine: every core, nothing to share
    monkeypatch.setattr(up.os, "cpu_count", lambda: 2)
    assert threads() == {"prefill-0": (1, 2), "decode-0": (1, 2)}
    assert threads("--num-prefill", "2") == {"prefill-0": (1, 2), "prefill-1": (1, 2), "decode-0": (1, 2)}
    monkeypatch.setattr(up.os, "cpu_count", lambda: 1)
    assert threads() == {"prefill-0": (1, 0), "decode-0": (1, 0)}


def test_up_banner_names_the_served_model_and_the_key_it_needs():
    from pdserve.deploy import up

    text = up.banner("https://127.0.0.1:8443", "my-model", api_key=True)
    assert '"model": "my-model"' in text and "curl -k https://127.0.0.1:8443/v1/chat/completions" in text
    assert 'Authorization: Bearer $PDSERVE_API_KEY' in text
    assert "Authorization" not in up.banner("http://127.0.0.1:8000", "m", api_key=False)


def test_a_bad_yaml_setting_is_one_line_naming_the_file_the_key_and_the_closest_key(tmp_path):
    import pytest

    cases = {"decode_polcy: round_robin\n": "unknown setting 'decode_polcy' (did you mean 'decode_policy'?)",
             "max_batch_size: many\n": "max_batch_size: 'many' is not an integer",
             "dtype: float8\n": "dtype: 'float8' is not one of float32, bfloat16, float16",
             "- a list\n": "expected a mapping"}
    for text, expected in cases.items():
        path = tmp_path / "up.yaml"
        path.write_text(text)
        with pytest.raises(SystemExit) as caught:
            resolve(build_parser().parse_args(["up", "--config", str(path)]), environ={})
        message = str(caught.value.code)
        assert message.startswith(f"pdserve: {path}: ") and expected in message and "\n" not in message
    with pytest.raises(SystemExit, match="PDSERVE_MAX_BATCH_SIZE='x' is not an integer"):
        resolve(build_parser().parse_args(["decode"]), environ={"PDSERVE_MAX_BATCH_SIZE": "x"})


def test_a_model_that_cannot_load_is_one_line_and_exit_2(capsys):
    assert cli.main(["decode", "--model", "/no/such/model", "--grpc-port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("pdserve decode: model '/no/such/model' not found")


def test_help_is_honest_every_benchmark_listed_and_no_default_said_twice_or_as_none(capsys):
    import re

    import pytest

    from pdserve.bench import cli as bench_cli

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    top = capsys.readouterr().out
    assert all(name in top for name in bench_cli.BENCHMARKS) and "prepare" in top
    for what in bench_cli.BENCHMARKS:
        with pytest.raises(SystemExit):
            bench_cli.load(what)(["--help"])
        text = capsys.readouterr().out
        assert "(default: None)" not in text, what
        for option in re.split(r"\n  (?=-)", text):
            assert len(re.findall(r"\(default", option)) <= 1, (what, option)


def test_worker_settings_are_the_one_table_of_worker_flags():
    """Each WorkerSettings field is declared once, with its flag: the role's parser offers
    exactly those fields, and `up` passes on exactly the engine and kv-transfer groups."""
    from dataclasses import fields

    from pdserve.deploy.cli import worker_pass_through
    from pdserve.worker.settings import GROUPS, WorkerSettings

    table = {f.name: f.metadata for f in fields(WorkerSettings) if f.name != "role"}
    assert all(spec.get("group") in GROUPS and spec.get("help") for spec in table.values())
    for role in ("prefill", "decode"):
        assert _dests(role) - {"config"} == {n for n, spec in table.items() if role in spec["roles"]}
    shared = {n for n, spec in table.items() if spec["group"] in ("engine", "kv transfer", "lifecycle")}
    assert set(worker_pass_through()) == shared | {"log_level"}


def test_router_config_is_the_one_table_of_router_flags():
    """The router's flags are RouterConfig's declared settings; up takes its routing group."""
    from dataclasses import fields

    from pdserve.deploy.cli import router_pass_through
    from pdserve.router.config import ROUTER_GROUPS, RouterConfig

    table = {f.name: f.metadata for f in fields(RouterConfig) if f.metadata}
    assert all(spec["group"] in ROUTER_GROUPS for spec in table.values())
    assert _dests("router") - {"config"} == set(table)
    assert set(router_pass_through()) == {n for n, s in table.items() if s["group"] == "routing"} - {"api_key"}


def test_a_new_worker_setting_is_one_field():
    """`seed`, added as one WorkerSettings field: a flag of both services, a YAML key, passed
    on by `up` to every worker, into the engine's config."""
    from pdserve.deploy import up
    from pdserve.worker.settings import WorkerSettings

    settings = resolve(build_parser().parse_args(["up", "--seed", "7"]), environ={})
    children, _ = up.plan(dict(settings, cluster_secret_file="/s"))
    for child in children[1:]:
        parsed = resolve(build_parser().parse_args(child.argv[3:]), environ={})
        assert WorkerSettings.from_settings(child.argv[3], parsed).engine_config().seed == 7
    assert resolve(build_parser().parse_args(["decode"]), environ={"PDSERVE_SEED": "3"})["seed"] in (3, "3")


def test_a_service_that_crashes_in_native_code_leaves_its_python_stacks_in_the_start_error():
    # a service killed by SIGSEGV (a kernel, UCX, gloo) must say where, not only "exited with -11"
    import sys

    import pytest

    from pdserve.deploy import up

    crash = ("import ctypes, pdserve.deploy.cli as c; "
             "c._role_main = lambda command: (lambda settings: ctypes.string_at(0)); c.main(['decode'])")
    child = up.Child("decode-0", [sys.executable, "-c", crash])
    up.spawn(child)
    with pytest.raises(RuntimeError) as err:
        up.wait_ready([child], "http://127.0.0.1:9", timeout_s=60)
    message = str(err.value)
    assert "decode-0 exited with -11" in message
    assert "Segmentation fault" in message and "string_at" in message

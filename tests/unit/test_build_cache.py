"""Build cache: hits skip the build, inputs key records, pruning, crash safety, races."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from pdserve.engine.build_cache import CACHE_FORMAT_VERSION, BuildCache, BuildInputs, BuildResult
from pdserve.common.errors import InvalidRequestError

GB = 1024**3


class CountingBuild:
    """A real build: writes `payload` into the directory it is given, and counts its runs."""

    def __init__(self, payload: bytes = b"converted") -> None:
        self.payload = payload
        self.runs = 0

    def __call__(self, out: Path) -> None:
        self.runs += 1
        (out / "weights.bin").write_bytes(self.payload)


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def set_last_used(result: BuildResult, seconds_ago: float) -> None:
    meta = result.path.parent / "metadata.json"
    stamp = time.time() - seconds_ago
    os.utime(meta, (stamp, stamp))


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    return path


@pytest.fixture
def cache(tmp_path: Path) -> BuildCache:
    return BuildCache(tmp_path / "cache", max_records=8, max_storage_gb=1.0)


def test_second_get_with_same_inputs_skips_the_build(cache, source):
    build = CountingBuild()
    inputs = BuildInputs.of(values={"dtype": "float32"}, files={"gguf": source})

    first = cache.get_or_build("gguf-convert", inputs, build, description="test conversion")
    second = cache.get_or_build("gguf-convert", inputs, build)

    assert (first.built, second.built) == (True, False)
    assert build.runs == 1
    assert second.path == first.path and second.key == first.key
    assert (second.path / "weights.bin").read_bytes() == b"converted"
    meta = json.loads((first.path.parent / "metadata.json").read_text())
    assert meta["format_version"] == CACHE_FORMAT_VERSION and meta["kind"] == "gguf-convert"
    assert meta["key"] == first.path.parent.name and meta["created"] <= time.time()
    assert meta["inputs"]["files"]["gguf"]["path"] == str(source.resolve())
    assert meta["inputs"]["values"] == {"dtype": "float32"} and meta["inputs"]["pdserve_version"]


def test_a_seed_cache_is_read_in_place_and_never_written(tmp_path, source):
    """An image's prepared cache (read-only) serves its records without a copy or a build;
    what it lacks is built under the writable root as usual."""
    inputs = BuildInputs.of(values={"dtype": "float32"}, files={"gguf": source})
    build = CountingBuild()
    prepared = BuildCache(tmp_path / "image", max_records=8, max_storage_gb=1.0).get_or_build(
        "gguf-convert", inputs, build)
    (tmp_path / "image").chmod(0o555)
    try:
        cache = BuildCache(tmp_path / "volume", max_records=8, max_storage_gb=1.0, seed=tmp_path / "image")
        hit = cache.get_or_build("gguf-convert", inputs, build)
        assert (hit.path, hit.built, build.runs) == (prepared.path, False, 1)
        assert not (tmp_path / "volume").exists()
        other = cache.get_or_build("gguf-convert", BuildInputs.of(values={"dtype": "bfloat16"},
                                                                  files={"gguf": source}), build)
        assert other.built and other.path.is_relative_to(tmp_path / "volume") and build.runs == 2
    finally:
        (tmp_path / "image").chmod(0o755)


def test_changed_input_makes_a_new_record(cache, source, tmp_path):
    build = CountingBuild()
    inputs = BuildInputs.of(files={"gguf": source})
    first = cache.get_or_build("gguf-convert", inputs, build)

    # Same size and mtime, different bytes: the key follows the content.
    stat = source.stat()
    data = bytearray(source.read_bytes())
    data[-1] ^= 0xFF
    source.write_bytes(bytes(data))
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    changed_file = cache.get_or_build("gguf-convert", inputs, build)
    changed_value = cache.get_or_build("gguf-convert", BuildInputs.of(
        values={"converter": "2"}, files={"gguf": source}), build)
    # The same bytes elsewhere are the same input.
    copy = tmp_path / "elsewhere.gguf"
    copy.write_bytes(source.read_bytes())
    moved = cache.get_or_build("gguf-convert", BuildInputs.of(files={"gguf": copy}), build)

    assert changed_file.built and changed_value.built and not moved.built
    assert len({first.key, changed_file.key, changed_value.key}) == 3
    assert moved.key == changed_file.key
    assert build.runs == 3
    assert [r.name for r in cache.records()].count(first.key) == 1  # the old record stays


def test_prune_keeps_at_most_max_records_least_recently_used_first(tmp_path):
    cache = BuildCache(tmp_path / "cache", max_records=2, max_storage_gb=1.0)
    build = CountingBuild()
    a = cache.get_or_build("t", BuildInputs.of(values={"n": "a"}), build)
    b = cache.get_or_build("t", BuildInputs.of(values={"n": "b"}), build)
    set_last_used(a, 30)
    set_last_used(b, 20)
    assert not cache.get_or_build("t", BuildInputs.of(values={"n": "a"}), build).built  # a: now

    c = cache.get_or_build("t", BuildInputs.of(values={"n": "c"}), build)

    assert sorted(r.name for r in cache.records()) == sorted([a.key, c.key])  # b was oldest
    assert not b.path.exists()
    assert build.runs == 3


def test_prune_honours_max_storage_gb_and_keeps_the_new_record(tmp_path):
    root = tmp_path / "cache"
    probe = BuildCache(tmp_path / "probe", max_records=100, max_storage_gb=1.0)
    record_bytes = tree_bytes(probe.get_or_build(
        "t", BuildInputs.of(values={"n": "p"}), CountingBuild(b"x" * 1000)).path.parent)
    # Room for two records of this size, not three (a fractional, byte-sized budget).
    cache = BuildCache(root, max_records=100, max_storage_gb=2.5 * record_bytes / GB)
    results = []
    for n in ("0", "1", "2"):
        results.append(cache.get_or_build("t", BuildInputs.of(values={"n": n}),
                                          CountingBuild(b"x" * 1000)))
        set_last_used(results[-1], 10 - int(n))

    kept = {r.name for r in cache.records()}
    assert kept == {results[1].key, results[2].key}
    assert sum(tree_bytes(root / k) for k in kept) <= cache.max_storage_bytes

    # A record larger than the whole budget is still kept: it was just built.
    big = cache.get_or_build("t", BuildInputs.of(values={"n": "big"}), CountingBuild(b"x" * 10_000))
    assert [r.name for r in cache.records()] == [big.key]


def test_failed_build_records_nothing_and_the_next_call_builds(cache, source):
    inputs = BuildInputs.of(files={"gguf": source})

    def crashing_build(out: Path) -> None:
        (out / "half.bin").write_bytes(b"partial")
        raise RuntimeError("conversion blew up")

    with pytest.raises(RuntimeError, match="blew up"):
        cache.get_or_build("gguf-convert", inputs, crashing_build)
    assert cache.records() == []
    assert [p.name for p in cache.root.iterdir()] == [".locks"]

    result = cache.get_or_build("gguf-convert", inputs, CountingBuild())
    assert result.built and sorted(p.name for p in result.path.iterdir()) == ["weights.bin"]


@pytest.mark.parametrize("damage", ["no metadata", "garbage metadata", "old format", "no content"])
def test_invalid_record_and_crash_leftovers_are_removed_and_rebuilt(cache, source, damage):
    inputs = BuildInputs.of(files={"gguf": source})
    key = cache.key_for("gguf-convert", inputs)
    record = cache.root / key
    (record / "content").mkdir(parents=True)
    (record / "content" / "weights.bin").write_bytes(b"half written")
    meta = {"format_version": CACHE_FORMAT_VERSION, "kind": "gguf-convert", "key": key,
            "created": time.time()}
    if damage == "garbage metadata":
        (record / "metadata.json").write_text("{not json")
    elif damage == "old format":
        (record / "metadata.json").write_text(json.dumps({**meta, "format_version": 0}))
    elif damage == "no content":
        (record / "metadata.json").write_text(json.dumps(meta))
        (record / "content" / "weights.bin").unlink()
        (record / "content").rmdir()
    leftover = cache.root / f".tmp-{key}-deadbeef"
    (leftover / "content").mkdir(parents=True)
    assert cache.records() == []

    result = cache.get_or_build("gguf-convert", inputs, CountingBuild())

    assert result.built
    assert (result.path / "weights.bin").read_bytes() == b"converted"
    assert not leftover.exists()
    assert [r.name for r in cache.records()] == [key]


def _run_cache_script(tmp_path: Path, body: str, *args: str) -> subprocess.Popen:
    script = tmp_path / "cache_script.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys, time
        from pathlib import Path
        from pdserve.engine.build_cache import BuildCache, BuildInputs
        root, log = Path(sys.argv[1]), Path(sys.argv[2])
        cache = BuildCache(root, max_records=8, max_storage_gb=1.0, lock_timeout_s=60)
        inputs = BuildInputs.of(values={"model": "m"})
    """) + textwrap.dedent(body))
    return subprocess.Popen([sys.executable, str(script), str(tmp_path / "cache"),
                             str(tmp_path / "builds.log"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_process_killed_mid_build_leaves_no_valid_record(tmp_path):
    proc = _run_cache_script(tmp_path, """
        def build(out):
            (out / "weights.bin").write_bytes(b"half")
            os._exit(3)  # the process dies: no cleanup, no exception handlers
        cache.get_or_build("t", inputs, build)
    """)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    cache = BuildCache(tmp_path / "cache", max_records=8, max_storage_gb=1.0)
    assert cache.records() == []
    assert any(p.name.startswith(".tmp-") for p in cache.root.iterdir())  # the crash's leftover

    result = cache.get_or_build("t", BuildInputs.of(values={"model": "m"}), CountingBuild())

    assert result.built and (result.path / "weights.bin").read_bytes() == b"converted"
    assert not any(p.name.startswith(".tmp-") for p in cache.root.iterdir())


def test_two_processes_racing_on_one_key_build_once(tmp_path):
    body = """
        def build(out):
            with open(log, "a") as f:
                f.write(f"{os.getpid()}\\n")
            time.sleep(1.0)
            (out / "weights.bin").write_bytes(b"built once")
        r = cache.get_or_build("t", inputs, build)
        print(json.dumps({"path": str(r.path), "built": r.built}))
    """
    procs = [_run_cache_script(tmp_path, body) for _ in range(2)]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        outputs.append(json.loads(out))

    assert len((tmp_path / "builds.log").read_text().split()) == 1
    assert sorted(o["built"] for o in outputs) == [False, True]
    assert outputs[0]["path"] == outputs[1]["path"]
    assert (Path(outputs[0]["path"]) / "weights.bin").read_bytes() == b"built once"


def test_prune_leaves_a_temporary_alone_while_its_key_is_locked(cache):
    from filelock import FileLock

    kept = cache.get_or_build("t", BuildInputs.of(values={"n": "kept"}), CountingBuild())
    busy_key = cache.key_for("t", BuildInputs.of(values={"n": "busy"}))
    in_progress = cache.root / f".tmp-{busy_key}-0123abcd"
    (in_progress / "content").mkdir(parents=True)

    with FileLock(cache.root / ".locks" / f"{busy_key}.lock", timeout=5):
        cache.prune()
        assert in_progress.exists()  # another process is building it right now
    cache.prune()
    assert not in_progress.exists()
    assert kept.path.exists()


def test_disabled_cache_builds_every_time_and_writes_nothing_under_root(tmp_path):
    cache = BuildCache(tmp_path / "cache", max_records=8, max_storage_gb=1.0, enabled=False)
    build = CountingBuild()
    inputs = BuildInputs.of(values={"n": "x"})

    first = cache.get_or_build("t", inputs, build)
    second = cache.get_or_build("t", inputs, build)

    assert first.built and second.built and build.runs == 2
    assert first.path != second.path and (second.path / "weights.bin").is_file()
    assert not (tmp_path / "cache").exists()


def test_from_env_reads_the_pdserve_cache_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_ROOT", str(tmp_path / "root"))
    monkeypatch.setenv("PDSERVE_CACHE_ENABLED", "0")
    monkeypatch.setenv("PDSERVE_CACHE_MAX_RECORDS", "3")
    monkeypatch.setenv("PDSERVE_CACHE_MAX_STORAGE_GB", "0.5")

    cache = BuildCache.from_env()

    assert (cache.root, cache.enabled, cache.max_records) == (tmp_path / "root", False, 3)
    assert cache.max_storage_bytes == GB // 2
    monkeypatch.setenv("PDSERVE_CACHE_MAX_RECORDS", "many")
    with pytest.raises(InvalidRequestError, match="PDSERVE_CACHE"):
        BuildCache.from_env()
    with pytest.raises(InvalidRequestError, match="max_records"):
        BuildCache(tmp_path, max_records=0, max_storage_gb=1.0)


def test_prune_leaves_what_is_not_a_record_alone(cache):
    """The cache root also holds the native kernels' builds (torch_extensions/) and other
    files: pruning once deleted them (a rebuild of the kernels on the next start)."""
    for name in ("torch_extensions", "synthetic", "notes"):
        (cache.root / name).mkdir(parents=True)
        (cache.root / name / "kept").write_text("x")
    cache.prune()
    assert all((cache.root / name / "kept").exists() for name in ("torch_extensions", "synthetic", "notes"))

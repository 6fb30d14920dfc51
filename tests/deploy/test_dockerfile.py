"""The container image recipe (deploy/Dockerfile), checked without a Docker engine: it
installs through deploy/install.sh exactly as CI does (so CI exercises its install step),
runs as the non-root user the chart expects, and starts the `pdserve` console script."""
from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from pdserve.deploy import cli

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile"
DOCKERIGNORE = REPO / "deploy" / "Dockerfile.dockerignore"
CHART_VALUES = REPO / "deploy" / "helm" / "pdserve" / "values.yaml"


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined, comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        result.append((keyword.upper(), rest.strip()))
        pending = ""
    assert not pending, "Dockerfile ends inside a continued line"
    return result


def arg_defaults() -> dict[str, str]:
    defaults = {}
    for keyword, rest in instructions():
        if keyword == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            defaults[name] = value
    return defaults


def expand(text: str, defaults: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults.get(m.group(1) or m.group(2), m.group(0)), text)


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[last_from:]


def test_image_installs_with_the_script_ci_runs() -> None:
    runs = [rest for keyword, rest in instructions() if keyword == "RUN"]
    installs = [r for r in runs if "deploy/install.sh" in r]
    assert len(installs) == 1
    (install,) = installs
    for variable in ("PDSERVE_TORCH_SPEC=", "PDSERVE_EXTRAS=", "PDSERVE_EDITABLE=0"):
        assert variable in install
    # No second way of installing: every Python package comes through the script.
    assert not any(re.search(r"\bpip3?\b|-m pip\b|\buv\b", r) for r in runs)
    script = (REPO / "deploy" / "install.sh").read_text()
    for variable in ("PDSERVE_TORCH_SPEC", "PDSERVE_EXTRAS", "PDSERVE_EDITABLE"):
        assert variable in script
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^\s*bash deploy/install\.sh\s*$", ci, re.M), "CI no longer runs deploy/install.sh"


def test_cuda_by_default_and_cpu_by_build_argument() -> None:
    defaults = arg_defaults()
    assert defaults["VARIANT"] == "cuda"
    stages = {m.group(1): m.group(0) for keyword, rest in instructions() if keyword == "FROM"
              for m in [re.search(r"AS\s+(\S+)", rest, re.I)] if m}
    assert {"base-cuda", "base-cpu"} <= set(stages)
    froms = [rest for keyword, rest in instructions() if keyword == "FROM"]
    assert froms[-1].split()[0] == "base-${VARIANT}"
    assert "nvidia/cuda" in expand(next(f for f in froms if f.endswith("base-cuda")), defaults)
    install = next(rest for keyword, rest in instructions() if keyword == "RUN" and "install.sh" in rest)
    assert "download.pytorch.org/whl/cpu" in install  # the CPU variant's torch wheel index


def test_every_base_image_is_pinned_by_digest() -> None:
    """A tag can be re-pushed; a digest cannot. Every FROM that names an image (not an
    earlier stage) resolves, with the defaults, to name:tag@sha256:<64 hex>."""
    defaults = arg_defaults()
    stages = set()
    for keyword, rest in instructions():
        if keyword != "FROM":
            continue
        words = [w for w in rest.split() if not w.startswith("--")]
        image = expand(words[0], {**defaults, "VARIANT": "cuda"})
        if image not in stages and not image.startswith("base-"):
            assert re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", image), image
        if len(words) >= 3 and words[1].upper() == "AS":
            stages.add(words[2])


def test_the_image_prepares_its_model_at_build_time_and_reads_it_in_place() -> None:
    """`pdserve prepare` converts the shipped model into a cache inside the image, and the
    runtime environment names that cache as the seed: no start converts it again."""
    steps = final_stage()
    prepare = next(rest for keyword, rest in steps if keyword == "RUN" and "pdserve prepare" in rest)
    seed_dir = re.search(r"PDSERVE_CACHE_ROOT=(\S+) pdserve prepare", prepare).group(1)
    assert "--skip-kernel" in prepare and "/opt/pdserve/model" in prepare  # a baked-in model too
    env = " ".join(rest for keyword, rest in steps if keyword == "ENV")
    assert f"PDSERVE_CACHE_SEED={seed_dir}" in env
    runs = [rest for keyword, rest in steps if keyword == "RUN"]
    assert runs.index(prepare) > next(i for i, r in enumerate(runs) if "install.sh" in r)


def test_image_runs_as_the_non_root_user_the_chart_expects() -> None:
    users = [rest for keyword, rest in final_stage() if keyword == "USER"]
    assert users, "the final stage sets no USER: it would run as root"
    uid, _, gid = expand(users[-1], arg_defaults()).partition(":")
    assert uid.isdigit() and int(uid) != 0  # numeric, so runAsNonRoot can verify it
    assert not gid or (gid.isdigit() and int(gid) != 0)
    chart = yaml.safe_load(CHART_VALUES.read_text())
    assert int(uid) == chart["podSecurityContext"]["runAsUser"]


def test_entrypoint_is_the_pdserve_console_script() -> None:
    stage = dict(final_stage())
    assert json.loads(stage["ENTRYPOINT"]) == ["pdserve"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["pdserve"] == "pdserve.deploy.cli:main"
    command = json.loads(stage["CMD"])
    namespace = cli.build_parser().parse_args(command)
    assert namespace.command == "up" and namespace.host == "0.0.0.0"


def test_model_can_be_baked_in_by_build_argument() -> None:
    defaults = arg_defaults()
    assert defaults.get("MODEL_PATH") == ""  # nothing baked in unless asked
    copy = next(rest for keyword, rest in instructions() if keyword == "RUN" and "MODEL_PATH" in rest)
    assert "/opt/pdserve/model" in copy
    chart = (REPO / "deploy" / "helm" / "pdserve" / "values.yaml").read_text()
    assert "/opt/pdserve/model" in chart  # the chart documents where to point --model


def test_build_context_keeps_what_the_install_needs() -> None:
    patterns = [p.strip() for p in DOCKERIGNORE.read_text().splitlines() if p.strip() and not p.startswith("#")]
    assert ".git" in patterns

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        return any(fnmatch.fnmatch(prefix, pattern.removeprefix("**/")) or fnmatch.fnmatch(prefix, pattern)
                   for pattern in patterns for prefix in prefixes)

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = ["pyproject.toml", "deploy/install.sh", "deploy/cli.py"]
    needed += [f"{folder}/__init__.py" for folder in pyproject["tool"]["setuptools"]["package-dir"].values()]
    assert [p for p in needed if ignored(p)] == []
    assert ignored("tests/deploy/test_dockerfile.py") and ignored("engine/__pycache__/x.pyc")


def test_exposed_ports_are_the_routers_which_the_default_command_serves() -> None:
    exposed = {int(p) for keyword, rest in final_stage() if keyword == "EXPOSE" for p in shlex.split(rest)}
    assert exposed == {cli.ROUTER_HTTP_PORT, cli.ROUTER_GRPC_PORT}


def _run_with_stubs(script: str, variant: str) -> str:
    """Runs a RUN step's shell with apt-get, the install script and pdserve replaced by stubs
    that print what they were asked to install, for the given VARIANT."""
    stubs = ('apt-get() { echo "apt-get $*"; }; bash() { echo "extras=$PDSERVE_EXTRAS"; }; '
             'pdserve() { :; }; python3() { :; }; groupadd() { :; }; useradd() { :; }; rm() { :; }; ')
    env = {**arg_defaults(), "VARIANT": variant, "PATH": "/usr/bin:/bin"}
    body = expand(script.removeprefix("--mount=type=bind,source=.,target=/src,rw").strip(), env)
    out = subprocess.run(["/bin/bash", "-c", stubs + body], env=env, capture_output=True,
                         text=True, check=True, timeout=10)
    return out.stdout


@pytest.mark.parametrize("variant", ["cuda", "cpu"])
def test_each_variant_carries_a_compiler_and_only_cuda_carries_triton(variant: str) -> None:
    runs = [rest for keyword, rest in instructions() if keyword == "RUN"]
    apt = _run_with_stubs(next(r for r in runs if "apt-get install" in r), variant)
    packages = set(next(line for line in apt.splitlines() if " install " in line).split())
    # Triton compiles its CUDA driver stub with a C compiler at run time; the CPU kernel is C++.
    assert {"gcc", "g++", "python3-dev"} <= packages
    install = _run_with_stubs(next(r for r in runs if "install.sh" in r), variant)
    extras = set(re.search(r"extras=(\S*)", install).group(1).split(","))
    assert "test" not in extras and "bench" not in extras
    assert ("triton" in extras) == (variant == "cuda")


def test_python_dependencies_are_pinned_by_the_constraints_file_the_install_uses() -> None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    script = (REPO / "deploy" / "install.sh").read_text()
    pip_lines = [l for l in script.splitlines() if re.match(r"\s*\$PIP .*\[\$\{EXTRAS\}\]", l)]
    assert pip_lines and all("-c deploy/constraints.txt" in l for l in pip_lines)
    pins = {}
    for line in (REPO / "deploy" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert re.fullmatch(r"[\w.+!-]+", version), line  # exact pins only
            pins[canonicalize_name(name)] = version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + [r for rs in project["optional-dependencies"].values() for r in rs]
    names = {canonicalize_name(Requirement(r).name) for r in wanted} - {"torch", "triton", "pdserve"}
    assert sorted(names - set(pins)) == []

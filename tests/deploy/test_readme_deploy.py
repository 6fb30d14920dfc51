"""The README's "Deploy on Kubernetes" commands, checked against what they act on: the image
tag pushed is the one built and the one installed; the chart rendered with exactly the
release, namespace, values files and --set flags shown (and each later `helm upgrade` on top)
validates and runs that image; kubectl talks to that namespace and port-forwards to a Service
and port the render has; curl asks the forwarded port."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def deploy_commands() -> list[list[str]]:
    """Every command of the section's bash blocks, continuation lines joined, comments dropped."""
    text = README.read_text()
    section = text.split("\n## Deploy on Kubernetes", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def option(words: list[str], *names: str) -> list[str]:
    return [words[i + 1] for i, w in enumerate(words) if w in names]


def apply_sets(values: dict, sets: list[str]) -> None:
    for item in sets:
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = values
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = int(value) if value.isdigit() else {"true": True, "false": False}.get(value, value)


def test_readme_deploy_commands_act_on_what_the_chart_renders() -> None:
    commands = deploy_commands()
    built = {tag for c in commands if c[:2] == ["docker", "build"] for tag in option(c, "-t")}
    pushed = {c[2] for c in commands if c[:2] == ["docker", "push"]}
    assert pushed and pushed <= built, (pushed, built)

    install = next(c for c in commands if c[:2] == ["helm", "install"])
    release, chart_path = install[2], install[3]
    namespace = option(install, "-n", "--namespace")[0]
    values: dict = {}
    for path in option(install, "-f", "--values"):
        values.update(yaml.safe_load((REPO / path).read_text()))
    apply_sets(values, option(install, "--set"))
    image = f"{values['image']['repository']}:{values['image']['tag']}"
    assert image in pushed, f"the chart installs {image}, the README pushes {pushed}"

    upgrades = [c for c in commands if c[:2] == ["helm", "upgrade"]]
    with helm.Chart.load(REPO / chart_path) as chart:
        for stage in [None, *upgrades]:
            if stage is not None:  # --reuse-values: the install's values plus this upgrade's
                assert (stage[2], stage[3]) == (release, chart_path) and "--reuse-values" in stage
                assert option(stage, "-n", "--namespace") == [namespace], stage
                apply_sets(values, option(stage, "--set"))
            chart.validate_schema(values)
            out = chart.render(values, name=release, namespace=namespace, is_install=stage is None)
            docs = [d for path, body in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(body) if d]
            containers = [c for d in docs if d["kind"] == "Deployment"
                          for c in d["spec"]["template"]["spec"]["containers"] if "pdserve" in c["image"]]
            assert containers and all(c["image"] == image for c in containers), [c["image"] for c in containers]

    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    forwards = []
    for c in commands:
        if c[0] == "kubectl":
            assert option(c, "-n", "--namespace") == [namespace], c
        if c[:1] == ["kubectl"] and "port-forward" in c:
            target, ports = c[c.index("port-forward") + 1:c.index("port-forward") + 3]
            local, _, remote = ports.partition(":")
            service = services[target.removeprefix("svc/")]
            assert int(remote) in {p["port"] for p in service["spec"]["ports"]}, c
            forwards.append(local)
    curls = [c for c in commands if c[0] == "curl"]
    assert forwards and curls
    assert all(re.match(rf"https?://(127\.0\.0\.1|localhost):({'|'.join(forwards)})/", c[-1]) for c in curls), curls

"""deploy/kind-smoke.sh cannot run here (no Docker, no kind); its commands are checked against
what they act on: the chart rendered with exactly the release, namespace, values file and
--set flags the script passes, and the Dockerfile's CPU variant."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "kind-smoke.sh"


def script_variables(text: str) -> dict[str, str]:
    """NAME=value and NAME=${ENV:-default} assignments, with their defaults."""
    out = {}
    for name, value in re.findall(r"^([A-Z_]+)=(\S+)$", text, re.M):
        m = re.fullmatch(r"\$\{\w+:-(.*)\}", value)
        out[name] = m.group(1) if m else value
    return out


def helm_install_args(text: str, variables: dict[str, str]) -> list[str]:
    joined = text.replace("\\\n", " ")
    line = next(l for l in joined.splitlines() if l.strip().startswith("helm install"))
    for name, value in variables.items():
        line = line.replace(f'"${name}"', value).replace(f"${name}", value)
    return shlex.split(line)


def test_smoke_script_installs_what_the_chart_renders() -> None:
    text = SCRIPT.read_text()
    variables = script_variables(text)
    args = helm_install_args(text, variables)
    release, chart_path = args[2], args[3]
    namespace = args[args.index("-n") + 1]
    values = yaml.safe_load((REPO / args[args.index("-f") + 1]).read_text())
    assert args[args.index("-f") + 1] == "deploy/helm/pdserve/ci/kind.yaml"
    for i, arg in enumerate(args):
        if arg == "--set":
            key, _, value = args[i + 1].partition("=")
            node = values
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
    with helm.Chart.load(REPO / chart_path) as chart:
        chart.validate_schema(values)
        out = chart.render(values, name=release, namespace=namespace, is_install=True)
    docs = [d for path, body in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(body) if d]
    # The Service it port-forwards to, on the port it forwards.
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    forward = re.search(r'port-forward "svc/\$RELEASE-router" "\$LOCAL_PORT:(\d+)"', text)
    router = services[f"{release}-router"]
    assert int(forward.group(1)) in {p["port"] for p in router["spec"]["ports"]}
    # The image it builds and loads, never pulled; the label its readiness wait selects.
    image = f"{variables['IMAGE']}:{variables['TAG']}"
    assert f'-t "$IMAGE:$TAG"' in text and "--build-arg VARIANT=cpu" in text
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    pdserve_containers = [c for d in deployments for c in d["spec"]["template"]["spec"]["containers"]
                          if c["image"] == image]
    assert len(pdserve_containers) == 4  # router, prefill, decode, enroller
    assert all(c["imagePullPolicy"] == "Never" for c in pdserve_containers)
    assert 'app.kubernetes.io/instance="$RELEASE"' in text
    assert all(d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/instance"] == release
               for d in deployments)
    assert 'helm uninstall "$RELEASE" -n "$NAMESPACE"' in text

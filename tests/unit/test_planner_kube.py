"""The Kubernetes scaler against the kubernetes client's own types: it reads and patches only
the scale subresource of the Deployments it was given, reports what the scale says, and an
API error is reported (never raised into the planner's loop)."""
from __future__ import annotations

import pytest

pytest.importorskip("kubernetes")

from kubernetes.client import ApiException, V1Scale, V1ScaleSpec, V1ScaleStatus  # noqa: E402

from pdserve.planner.kube import KubernetesScaler  # noqa: E402


class ScaleOnlyApi:
    """An AppsV1Api that answers the two scale calls, the only ones the planner's Role allows."""

    def __init__(self, replicas: dict[str, tuple[int, int]]) -> None:
        self.replicas = dict(replicas)  # name -> (spec, status)
        self.patches: list[tuple[str, str, dict]] = []
        self.refuse = False

    def read_namespaced_deployment_scale(self, name: str, namespace: str) -> V1Scale:
        spec, status = self.replicas[name]
        return V1Scale(spec=V1ScaleSpec(replicas=spec), status=V1ScaleStatus(replicas=status))

    def patch_namespaced_deployment_scale(self, name: str, namespace: str, body: dict) -> V1Scale:
        if self.refuse:
            raise ApiException(status=403, reason="Forbidden")
        self.patches.append((name, namespace, body))
        self.replicas[name] = (body["spec"]["replicas"], self.replicas[name][1])
        return self.read_namespaced_deployment_scale(name, namespace)

    def __getattr__(self, name: str):
        raise AssertionError(f"the planner called {name}, which its Role does not allow")


def test_scale_reads_and_patches_only_the_scale_subresource():
    api = ScaleOnlyApi({"r-prefill": (1, 1), "r-decode": (2, 1)})
    scaler = KubernetesScaler("llm", {"prefill": "r-prefill", "decode": "r-decode"}, apps_api=api)
    assert scaler.roles() == ("prefill", "decode")
    counts = scaler.counts()
    assert (counts["decode"].target, counts["decode"].ready, counts["decode"].starting) == (2, 1, 1)
    scaler.set_target("decode", 3, "more streams")
    assert api.patches == [("r-decode", "llm", {"spec": {"replicas": 3}})]
    assert scaler.counts()["decode"].target == 3
    api.refuse = True
    scaler.set_target("prefill", 2, "longer prompts")  # reported, not raised
    assert "Forbidden" in scaler.counts()["prefill"].last_failure and scaler.counts()["prefill"].target == 1

"""The live planner in a Kubernetes cluster (`pdserve planner`, the chart's planner component):
the `Scaler` patches the prefill and decode Deployments' replica counts through their scale
subresource, the only thing its Role lets it touch (get and patch of deployments/scale of
those two Deployments).

What the scale subresource tells is what it counts: `target` is spec.replicas, `ready` the
pods the Deployment has (status.replicas); which of them serve is the router's to say (the
planner's observation counts the registered workers). Starts are the Deployment
controller's: a pod that fails to start is restarted by Kubernetes with its own back-off, and
never registers, so it never counts in the router's metrics. A removed pod gets SIGTERM and
drains (`worker.drain`) within its termination grace period.

`kubernetes` is imported only here, when this scaler is built."""
from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Mapping

from pdserve.planner.scalers import RoleCount

log = logging.getLogger("pdserve.planner.kube")


class KubernetesScaler:
    def __init__(self, namespace: str, deployments: Mapping[str, str], apps_api: Any = None) -> None:
        """`deployments`: role -> Deployment name; `apps_api`: an AppsV1Api (default: from the
        pod's service account, else the local kubeconfig)."""
        self.namespace = namespace
        self.deployments = dict(deployments)
        self._api = apps_api if apps_api is not None else _apps_api()
        self._failures: dict[str, str] = {}

    def roles(self) -> tuple[str, ...]:
        return tuple(self.deployments)

    def counts(self) -> dict[str, RoleCount]:
        out = {}
        for role, name in self.deployments.items():
            try:
                scale = self._api.read_namespaced_deployment_scale(name, self.namespace)
            except Exception as err:  # noqa: BLE001 - an API error costs this look, never the planner
                log.warning("planner: reading the scale of deployment %s failed: %s", name, err)
                out[role] = RoleCount(0, 0, last_failure=str(err))
                continue
            target = int(scale.spec.replicas or 0)
            current = int(getattr(scale.status, "replicas", 0) or 0)
            out[role] = RoleCount(target, min(target, current), starting=max(0, target - current),
                                  draining=max(0, current - target), last_failure=self._failures.get(role, ""))
        return out

    def set_target(self, role: str, count: int, reason: str) -> None:
        name = self.deployments[role]
        log.info("planner: scaling deployment %s to %d (%s)", name, count, reason)
        try:
            self._api.patch_namespaced_deployment_scale(name, self.namespace, {"spec": {"replicas": int(count)}})
            self._failures.pop(role, None)
        except Exception as err:  # noqa: BLE001 - reported; the planner asks again next interval
            self._failures[role] = f"patching deployment {name}: {err}"
            log.error("planner: %s", self._failures[role])


def _apps_api():
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.AppsV1Api()


def main(settings: dict[str, Any]) -> int:
    """`pdserve planner`: the live planner against the router at --router-url, scaling the
    Deployments named by --prefill-deployment and --decode-deployment, until SIGTERM."""
    from pdserve.planner.runner import RunningPlanner
    from pdserve.planner.settings import PlannerSettings

    logging.basicConfig(level=getattr(logging, str(settings.get("log_level") or "INFO").upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    s = PlannerSettings.from_settings(settings)
    deployments = {"prefill": s.prefill_deployment, "decode": s.decode_deployment}
    scaler = KubernetesScaler(s.namespace, {role: name for role, name in deployments.items() if name})
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    running = RunningPlanner(s, scaler, s.router_url, s.api_key,
                             host=settings.get("host") or "127.0.0.1").start()
    log.info("planner: reading %s every %g s, scaling %s in namespace %s", s.router_url, s.planner_interval_s,
             ", ".join(scaler.deployments.values()), s.namespace)
    stop.wait()
    running.stop()
    return 0

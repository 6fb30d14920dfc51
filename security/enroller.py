"""The enroller's rule: which pod of a Kubernetes deployment gets which enrollment token.

Threat: a process in the cluster asking for a worker identity it was not given: a pod of
another release or namespace, a pod under another ServiceAccount (the router's, a job's), a
token meant for another audience (one an unrelated service received and replays here), a pod
that is gone or being deleted, a pod asking for another pod's id or address; and a flood of
such asks, which must cost the enroller little and never its key.

Rule: the caller shows a projected ServiceAccount token, which the cluster itself reviews
(`Cluster.review`: TokenReview, with this enroller's audience). A token is issued only when
the review says authenticated, for this audience, to a ServiceAccount of this namespace that
`EnrollerPolicy.roles` maps to a worker role, and names a pod (its name and uid, the
`authentication.kubernetes.io/pod-*` extras a bound token carries). That pod, looked up
(`Cluster.pod`), must have the same uid, run under that same ServiceAccount, carry this
release's labels and the role's component label, have an IP, and be neither finished nor
being deleted. The token then names worker id = the pod's name, the role, and host = the
pod's IP (`security.enrollment`): it registers only that pod's own address. The caller
chooses nothing. This module holds the rule; the HTTP endpoint and the Kubernetes client
are adapters (`pdserve.deploy.enroller`).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

from pdserve.common.errors import AuthError
from pdserve.security.enrollment import EnrollmentIssuer

POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"
COMPONENT_LABEL = "app.kubernetes.io/component"
MAX_SA_TOKEN_CHARS = 8192  # a projected token is a JWT of about a kilobyte
_LIVE_PHASES = ("Pending", "Running")  # Pending: its init containers (the enroll step) run


class EnrollRefused(AuthError):
    """The caller gets no token; the message says which rule it failed."""


@dataclass(frozen=True, slots=True)
class Review:
    """What the cluster said about a ServiceAccount token (TokenReview status)."""

    authenticated: bool
    username: str = ""
    audiences: tuple[str, ...] = ()
    pod_name: str = ""
    pod_uid: str = ""
    error: str = ""


@dataclass(frozen=True, slots=True)
class Pod:
    """The facts of a pod the rule reads (None from `Cluster.pod`: no such pod)."""

    name: str
    uid: str
    namespace: str
    service_account: str
    labels: Mapping[str, str]
    phase: str
    ip: str
    deleting: bool = False


class Cluster(Protocol):
    """The two questions the enroller asks the Kubernetes API; each has a deadline and raises
    OSError (or its own transport error, wrapped by the adapter) when the API is not reached."""

    def review(self, token: str, audience: str) -> Review: ...

    def pod(self, namespace: str, name: str) -> Pod | None: ...


@dataclass(frozen=True, slots=True)
class EnrollerPolicy:
    """namespace: the release's; audience: what the workers' projected tokens are for;
    roles: ServiceAccount name -> worker role; release_labels: labels every pod of the release
    carries (its component label is the role)."""

    namespace: str
    audience: str
    roles: Mapping[str, str]
    release_labels: Mapping[str, str] = field(default_factory=dict)

    def role_of(self, review: Review) -> str:
        """The worker role of a reviewed caller; EnrollRefused unless the review admits one."""
        if not review.authenticated:
            raise EnrollRefused(f"the ServiceAccount token is not authenticated{_because(review.error)}")
        if self.audience not in review.audiences:
            raise EnrollRefused(f"the ServiceAccount token is not for audience {self.audience!r}")
        namespace, _, account = review.username.removeprefix(SERVICE_ACCOUNT_PREFIX).partition(":")
        if not review.username.startswith(SERVICE_ACCOUNT_PREFIX) or namespace != self.namespace:
            raise EnrollRefused(f"{review.username!r} is no ServiceAccount of namespace {self.namespace!r}")
        role = self.roles.get(account)
        if role is None:
            raise EnrollRefused(f"ServiceAccount {account!r} enrolls no worker role")
        if not review.pod_name or not review.pod_uid:
            raise EnrollRefused("the ServiceAccount token is bound to no pod (mount a projected token)")
        return role

    def check_pod(self, review: Review, role: str, pod: Pod | None) -> Pod:
        """The pod the review names, checked against it and the release; EnrollRefused else."""
        if pod is None or pod.uid != review.pod_uid:
            raise EnrollRefused(f"pod {review.pod_name!r} (uid {review.pod_uid}) does not exist")
        account = review.username.rpartition(":")[2]
        if pod.namespace != self.namespace or pod.service_account != account:
            raise EnrollRefused(f"pod {pod.name!r} does not run as ServiceAccount {account!r} here")
        wanted = {**self.release_labels, COMPONENT_LABEL: role}
        if any(pod.labels.get(key) != value for key, value in wanted.items()):
            raise EnrollRefused(f"pod {pod.name!r} is no {role} pod of this release")
        if pod.deleting or pod.phase not in _LIVE_PHASES or not pod.ip:
            raise EnrollRefused(f"pod {pod.name!r} is {pod.phase}{' and being deleted' if pod.deleting else ''}"
                                f"{'' if pod.ip else ' with no IP'}: not one that joins")
        return pod


def _because(error: str) -> str:
    return f" ({error[:200]})" if error else ""


class RateLimit:
    """A token bucket: `rate` grants a second, at most `burst` at once; `try_take` never waits."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate, self._burst, self._clock = rate, burst, clock
        self._tokens, self._at = float(burst), clock()
        self._lock = threading.Lock()

    def try_take(self) -> bool:
        with self._lock:
            now = self._clock()
            self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
            self._at = now
            if self._tokens < 1:
                return False
            self._tokens -= 1
            return True


class Enroller:
    """Issues a worker's enrollment token to the pod whose ServiceAccount token it is shown."""

    def __init__(self, issuer: EnrollmentIssuer, policy: EnrollerPolicy, cluster: Cluster) -> None:
        self._issuer, self._policy, self._cluster = issuer, policy, cluster

    def enroll(self, sa_token: str) -> tuple[str, str, str]:
        """(enrollment token, worker id, role) for the pod `sa_token` is bound to; EnrollRefused
        when the rule says no; OSError when the cluster could not be asked."""
        if not sa_token or len(sa_token) > MAX_SA_TOKEN_CHARS or not sa_token.isascii() or " " in sa_token:
            raise EnrollRefused(f"a ServiceAccount token is one word of at most {MAX_SA_TOKEN_CHARS} characters")
        review = self._cluster.review(sa_token, self._policy.audience)
        role = self._policy.role_of(review)
        pod = self._policy.check_pod(review, role, self._cluster.pod(self._policy.namespace, review.pod_name))
        return self._issuer.issue(pod.name, role, pod.ip), pod.name, role

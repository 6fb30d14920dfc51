"""The chart's enrollment (issue 48, "Enrollment of one's own", outside `pdserve up`), through
real processes: `pdserve enrollment-keygen` makes the key, `pdserve enroller` holds it and
asks a Kubernetes API (here a small real HTTP server on 127.0.0.1 that answers TokenReview
and pod reads as the API server does: the cluster cannot run here) about each pod's projected
ServiceAccount token, `pdserve enroll` fetches a worker's token as the chart's init container
does, and a real `pdserve router` holding only the public key admits the worker with that
token, refuses one with only the cluster secret, and removes a revoked one."""
from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import httpx
import pytest
from router_fakes import WAIT_S, FakeWorker, LoopThread, wait_until

from pdserve.proto.pdserve.v1 import registry_pb2, registry_pb2_grpc
from pdserve.security.credentials import CREDENTIAL_HEADER, CallKey, CallSigner
from pdserve.security.enrollment import ENROLLMENT_HEADER
from pdserve.security.secret import ClusterSecret

NAMESPACE = "llm"
AUDIENCE = "pdserve-enroll"
RELEASE_LABELS = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": "rel"}
ACCOUNTS = {"prefill": "rel-prefill", "decode": "rel-decode"}
START_S = 30.0
_NO_TOKEN = "registering needs this worker's own enrollment token; the cluster secret alone admits no worker"  # a CLI process prints its ready line by then


@dataclass
class FakeKubeAPI:
    """TokenReview and pod reads as the API server answers them, from two tables."""

    tokens: dict[str, dict] = field(default_factory=dict)  # token -> account, audiences, pod, uid[, valid]
    pods: dict[str, dict] = field(default_factory=dict)  # name -> Pod object
    num_reviews: int = 0

    def start(self) -> str:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert self.path == "/apis/authentication.k8s.io/v1/tokenreviews", self.path
                api.num_reviews += 1
                self._send(201, {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                                 "spec": body["spec"], "status": api.review(body["spec"])})

            def do_GET(self) -> None:
                prefix = f"/api/v1/namespaces/{NAMESPACE}/pods/"
                pod = api.pods.get(self.path.removeprefix(prefix)) if self.path.startswith(prefix) else None
                if pod is None:
                    self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404,
                                     "reason": "NotFound", "message": "pods not found"})
                else:
                    self._send(200, pod)

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def review(self, spec: dict) -> dict:
        known = self.tokens.get(spec["token"])
        wanted = spec.get("audiences") or []
        if known is None or not known.get("valid", True):
            return {"authenticated": False, "error": "invalid bearer token"}
        audiences = [a for a in known["audiences"] if a in wanted]
        if not audiences:
            return {"authenticated": False, "error": "token audiences is invalid for the target audiences"}
        namespace, account = known.get("namespace", NAMESPACE), known["account"]
        bound = {"authentication.kubernetes.io/pod-name": [known["pod"]],
                 "authentication.kubernetes.io/pod-uid": [known["uid"]]} if known["pod"] else {}
        return {"authenticated": True, "audiences": audiences,
                "user": {"username": f"system:serviceaccount:{namespace}:{account}", "uid": "u-1",
                         "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"],
                         "extra": bound}}

    def add_pod(self, name: str, role: str, *, account: str | None = None, phase: str = "Pending",
                ip: str = "127.0.0.1", labels: dict | None = None, deleting: bool = False, token: str = "",
                audiences: tuple[str, ...] = (AUDIENCE,), token_account: str | None = None) -> str:
        """A pod of `role` (its SA token `token`, default "sa-<name>"); returns the token."""
        uid = f"uid-{name}"
        metadata = {"name": name, "namespace": NAMESPACE, "uid": uid,
                    "labels": labels if labels is not None else {**RELEASE_LABELS, "app.kubernetes.io/component": role}}
        if deleting:
            metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        self.pods[name] = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata,
                           "spec": {"serviceAccountName": account or ACCOUNTS[role],
                                    "containers": [{"name": role, "image": "pdserve"}]},
                           "status": {"phase": phase, "podIP": ip}}
        token = token or f"sa-{name}"
        self.tokens[token] = {"account": token_account or account or ACCOUNTS[role], "audiences": list(audiences),
                              "pod": name, "uid": uid}
        return token


def _start(argv: list[str], ready: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "pdserve.deploy.cli", *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    readable, _, _ = select.select([process.stdout], [], [], START_S)
    line = process.stdout.readline() if readable else ""
    if not line.startswith(ready):
        process.kill()
        raise AssertionError(f"{argv[0]} did not start: {line!r} {process.stderr.read()}")
    return process, line.split()[3]


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        assert process.wait(timeout=WAIT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=WAIT_S)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("enrollment-key")
    subprocess.run([sys.executable, "-m", "pdserve.deploy.cli", "enrollment-keygen", "--out-dir", str(folder)],
                   check=True, timeout=START_S, capture_output=True)
    assert (folder / "private.pem").stat().st_mode & 0o077 == 0
    return folder


def _enroller_argv(keys: Path, api_url: str, *extra: str) -> list[str]:
    argv = ["enroller", "--enrollment-key-file", str(keys / "private.pem"), "--namespace", NAMESPACE,
            "--audience", AUDIENCE, "--port", "0", "--kube-api-url", api_url, "--api-timeout-s", "5", *extra]
    for role, account in ACCOUNTS.items():
        argv += ["--role-account", f"{role}={account}"]
    for key, value in RELEASE_LABELS.items():
        argv += ["--release-label", f"{key}={value}"]
    return argv


@pytest.fixture(scope="module")
def enroller(keys):
    api = FakeKubeAPI()
    process, url = _start(_enroller_argv(keys, api.start(), "--rate", "100", "--burst", "100"),
                          "pdserve enroller ready")
    yield api, url
    _stop(process)
    api.server.shutdown()


def _enroll(url: str, sa_token: str, out: Path, timeout_s: float = WAIT_S) -> subprocess.CompletedProcess:
    token_file = out.with_suffix(".sa")
    token_file.write_text(sa_token)
    return subprocess.run([sys.executable, "-m", "pdserve.deploy.cli", "enroll", "--enroller-url", url,
                           "--service-account-token-file", str(token_file), "--out", str(out),
                           "--timeout-s", str(timeout_s)], capture_output=True, text=True, timeout=START_S + timeout_s)


def test_the_enroller_refuses_what_the_cluster_does_not_vouch_for(enroller, tmp_path):
    api, url = enroller
    cases = {
        "an unknown token": ("forged", "not authenticated"),
        "another audience": (api.add_pod("d-aud", "decode", audiences=("https://kubernetes.default.svc",)),
                             "not authenticated"),
        "the router's ServiceAccount": (api.add_pod("d-router-sa", "decode", account="rel"), "enrolls no worker"),
        "a prefill pod asking as decode": (api.add_pod("p-cross", "prefill", token_account=ACCOUNTS["decode"]),
                                           "does not run as"),
        "a finished pod": (api.add_pod("d-done", "decode", phase="Succeeded"), "not one that joins"),
        "a pod being deleted": (api.add_pod("d-gone", "decode", deleting=True), "being deleted"),
        "a pod of another release": (api.add_pod("d-other", "decode", labels={
            **RELEASE_LABELS, "app.kubernetes.io/instance": "other", "app.kubernetes.io/component": "decode"}),
            "no decode pod of this release"),
    }
    api.tokens["sa-no-pod"] = {"account": ACCOUNTS["decode"], "audiences": [AUDIENCE], "pod": "ghost", "uid": "x"}
    cases["a pod that does not exist"] = ("sa-no-pod", "does not exist")
    api.tokens["sa-stale"] = {**api.tokens[api.add_pod("d-new", "decode")], "uid": "uid-of-the-pod-before"}
    cases["a token of an earlier pod of that name"] = ("sa-stale", "does not exist")
    api.tokens["sa-unbound"] = {"account": ACCOUNTS["decode"], "audiences": [AUDIENCE], "pod": "", "uid": ""}
    cases["a token bound to no pod"] = ("sa-unbound", "bound to no pod")
    api.tokens["sa-elsewhere"] = {**api.tokens[api.add_pod("d-ns", "decode")], "namespace": "other"}
    cases["a ServiceAccount of another namespace"] = ("sa-elsewhere", "no ServiceAccount of namespace")
    for what, (sa_token, reason) in cases.items():
        done = _enroll(url, sa_token, tmp_path / "token")
        assert done.returncode == 2 and reason in done.stderr, (what, done.stderr)
        assert not (tmp_path / "token").exists(), what
    with httpx.Client(base_url=url, timeout=WAIT_S) as http:
        assert http.post("/v1/enroll").status_code == 401
        assert http.post("/v1/enroll", headers={"Authorization": "Bearer " + "x" * 9000}).status_code == 403
        assert http.post("/v1/enroll", headers={"Authorization": "Bearer t"}, content=b"{}").status_code == 413
        assert http.get("/v1/enroll").status_code == 404 and http.get("/healthz").status_code == 200
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as raw:
        raw.sendall(b"POST /v1/enroll HTTP/1.0\r\nAuthorization: Bearer t\r\nContent-Length: x\r\n\r\n")
        assert raw.recv(64).startswith(b"HTTP/1.0 400")
    assert httpx.get(f"{url}/healthz", timeout=WAIT_S).status_code == 200  # and it serves on


def test_asks_past_the_rate_or_the_connection_bound_are_refused_cheaply(keys, tmp_path):
    api = FakeKubeAPI()
    process, url = _start(_enroller_argv(keys, api.start(), "--rate", "0.001", "--burst", "2",
                                         "--max-connections", "2", "--connection-deadline-s", "2"),
                          "pdserve enroller ready")
    try:
        sa_token = api.add_pod("d-busy", "decode")
        with httpx.Client(base_url=url, timeout=WAIT_S) as http:
            codes = [http.post("/v1/enroll", headers={"Authorization": f"Bearer {sa_token}"}).status_code
                     for _ in range(4)]
            assert codes == [200, 200, 429, 429] and api.num_reviews == 2
        # two silent connections hold both slots: a third is closed unserved
        host, port = url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port)), timeout=WAIT_S) for _ in range(2)]
        for held in idle:
            held.sendall(b"GET /healthz HTTP/1.0\r\n")  # headers begun, never finished
        try:
            def refused() -> bool:
                with socket.create_connection((host, int(port)), timeout=WAIT_S) as third:
                    try:
                        third.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
                        return third.recv(64) == b""
                    except (ConnectionResetError, BrokenPipeError):  # closed with our bytes unread
                        return True
            wait_until(refused, "a connection past the bound closed unserved")
            for held in idle:  # the connection deadline closes them, and frees their slots
                assert held.recv(64) == b""
        finally:
            for held in idle:
                held.close()
        wait_until(lambda: httpx.get(f"{url}/healthz", timeout=WAIT_S).status_code == 200, "the slots back")
    finally:
        _stop(process)
        api.server.shutdown()


def test_an_unreachable_api_is_retried_by_the_worker_until_its_deadline(keys, tmp_path):
    api = FakeKubeAPI()
    api_url = api.start()
    api.server.shutdown()
    api.server.server_close()  # nothing listens there now
    process, url = _start(_enroller_argv(keys, api_url, "--api-timeout-s", "1"), "pdserve enroller ready")
    try:
        done = _enroll(url, "any", tmp_path / "token", timeout_s=2)
        assert done.returncode == 1 and "not reached" in done.stderr, done.stderr
    finally:
        _stop(process)


@pytest.fixture(scope="module")
def router(keys, tmp_path_factory):
    folder = tmp_path_factory.mktemp("router")
    secret_path = folder / "cluster-secret"
    ClusterSecret.create(secret_path)
    revoked = folder / "revoked-workers"
    revoked.write_text("# revoked worker ids\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        registry_port = probe.getsockname()[1]
    process, http_url = _start(["router", "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0",
                                "--registry-port", str(registry_port), "--cluster-secret-file", str(secret_path),
                                "--enrollment-public-key-file", str(keys / "public.pem"),
                                "--revoked-workers-file", str(revoked), "--log-level", "WARNING"],
                               "pdserve router ready")
    loop = LoopThread()
    yield {"http": http_url, "registry": f"127.0.0.1:{registry_port}", "secret": ClusterSecret.load(str(secret_path)),
           "revoked": revoked, "loop": loop}
    loop.close()
    _stop(process)


def _num_decodes(router) -> int:
    return httpx.get(f"{router['http']}/health", timeout=WAIT_S).json()["decode_workers"]


def _register_raw(router, worker: FakeWorker, token: str | None) -> tuple[grpc.StatusCode, str]:
    signer = CallSigner(router["secret"], worker.worker_id, CallKey())
    metadata = [(CREDENTIAL_HEADER, signer.credential("/pdserve.v1.Registry/Register"))]
    if token is not None:
        metadata.append((ENROLLMENT_HEADER, token))
    request = registry_pb2.RegisterRequest(worker=worker.info(), public_key=signer.public_key)
    with grpc.insecure_channel(router["registry"]) as channel:
        try:
            registry_pb2_grpc.RegistryStub(channel).Register(request, timeout=WAIT_S, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def test_a_worker_joins_with_its_issued_token_and_a_rogue_with_the_secret_does_not(enroller, router, tmp_path):
    api, url = enroller
    loop = router["loop"]
    worker = FakeWorker(registry_pb2.WORKER_ROLE_DECODE, "rel-decode-7d9f-abcde")
    loop.run(worker.start())
    done = _enroll(url, api.add_pod(worker.worker_id, "decode"), tmp_path / "token")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "token").stat().st_mode & 0o077 == 0
    token = (tmp_path / "token").read_text().strip()
    assert token.split(" ")[1:4] == [worker.worker_id, "decode", "127.0.0.1"]
    try:
        loop.run(worker.register(router["registry"], CallSigner(router["secret"], worker.worker_id, CallKey()),
                                 enrollment_token=token))
        assert _num_decodes(router) == 1
        # a rogue with the cluster secret alone, or with the real worker's token under its own id
        rogue = FakeWorker(registry_pb2.WORKER_ROLE_DECODE, "decode-rogue")
        loop.run(rogue.start())
        try:
            assert _register_raw(router, rogue, None) == (grpc.StatusCode.UNAUTHENTICATED, _NO_TOKEN)
            code, reason = _register_raw(router, rogue, token)
            assert code == grpc.StatusCode.UNAUTHENTICATED and "not 'decode-rogue'" in reason, reason
        finally:
            loop.run(rogue.kill())
        assert _num_decodes(router) == 1
        # revoked: removed at once, and its token admits it no more
        with open(router["revoked"], "a") as f:
            f.write(f"{worker.worker_id}\n")
        wait_until(lambda: _num_decodes(router) == 0, "the revoked worker removed")
        assert _register_raw(router, worker, token) == (grpc.StatusCode.UNAUTHENTICATED,
                                                        f"worker {worker.worker_id!r} is revoked")
    finally:
        loop.run(worker.kill())


def test_under_internal_tls_only_a_client_that_checks_the_certificate_is_answered(keys, tmp_path):
    from pki import TestCA

    tls = TestCA(tmp_path).issue("enroller", dns_names=["pdserve-internal"])
    api = FakeKubeAPI()
    process, url = _start(_enroller_argv(keys, api.start(), "--tls-cert", tls.cert, "--tls-key", tls.key),
                          "pdserve enroller ready")
    try:
        assert url.startswith("https://127.0.0.1:")
        sa_token = api.add_pod("d-tls", "decode")
        token_file = tmp_path / "sa"
        token_file.write_text(sa_token)
        base = [sys.executable, "-m", "pdserve.deploy.cli", "enroll", "--enroller-url", url,
                "--service-account-token-file", str(token_file), "--out", str(tmp_path / "token")]
        # no CA: the certificate is not trusted, nothing is sent, and the deadline ends it
        refused = subprocess.run([*base, "--timeout-s", "2"], capture_output=True, text=True, timeout=START_S)
        assert refused.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in refused.stderr, refused.stderr
        assert api.num_reviews == 0
        done = subprocess.run([*base, "--ca-file", tls.ca, "--server-name", "pdserve-internal"],
                              capture_output=True, text=True, timeout=START_S)
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "token").read_text().split(" ")[1:3] == ["d-tls", "decode"]
    finally:
        _stop(process)
        api.server.shutdown()

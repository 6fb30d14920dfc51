"""The chart's enroller and its client: `pdserve enroller`, `pdserve enroll`, `pdserve
enrollment-keygen`.

`pdserve enroller` alone holds the enrollment key. It answers `POST /v1/enroll` (header
`Authorization: Bearer <projected ServiceAccount token>`) with the enrollment token of the
pod that token is bound to, as `security.enroller` decides, asking the Kubernetes API
(TokenReview, then the pod) through the `kubernetes` client: in-cluster config, or
`--kube-api-url` (tests). `GET /healthz` answers its probes. Connections are bounded, each
socket operation has a deadline, asks are rate-limited before the API is asked anything.

`pdserve enroll` runs in a worker pod's init container: it shows the pod's projected token,
retries while the enroller is not up (until its deadline) and writes the enrollment token
into a private file the worker reads with `--enrollment-token-file`.
"""
from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from pdserve.common.bounded_http import BoundedHandler, BoundedServer
from pdserve.security.secret import write_private_file

log = logging.getLogger("pdserve.enroller")

ENROLL_PATH = "/v1/enroll"
MAX_ANSWER_BYTES = 4096


def add_parsers(sub) -> None:
    p = sub.add_parser("enroller", help="issue workers' enrollment tokens to pods the cluster vouches for (the chart)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--enrollment-key-file", required=True, help="PEM Ed25519 private key (a private file)")
    p.add_argument("--namespace", required=True, help="the release's namespace: its pods alone enroll")
    p.add_argument("--audience", default="pdserve-enroll", help="audience of the workers' projected tokens")
    p.add_argument("--role-account", action="append", default=[], metavar="ROLE=SERVICEACCOUNT",
                   help="a worker role and the ServiceAccount its pods run as (repeat per role)")
    p.add_argument("--release-label", action="append", default=[], metavar="KEY=VALUE",
                   help="a label every pod of the release carries (repeat)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8095, help="port to bind (0: a free one)")
    p.add_argument("--kube-api-url", default="", help="Kubernetes API URL (default: the in-cluster config)")
    p.add_argument("--api-timeout-s", type=float, default=5.0, help="deadline of each Kubernetes API call")
    p.add_argument("--rate", type=float, default=10.0, help="enrollments a second, at most (burst: --burst)")
    p.add_argument("--burst", type=int, default=20)
    p.add_argument("--max-connections", type=int, default=64, help="connections served at once")
    p.add_argument("--connection-deadline-s", type=float, default=10.0,
                   help="a connection is closed this long after it opened, answered or not")
    p.add_argument("--tls-cert", default="", help="PEM certificate: serve HTTPS (the chart: the internal TLS one)")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--log-level", default="INFO")
    c = sub.add_parser("enroll", help="fetch this pod's enrollment token from the enroller (a worker's init step)")
    c.add_argument("--enroller-url", required=True, help="e.g. http://pdserve-enroller:8095")
    c.add_argument("--service-account-token-file", required=True, help="the pod's projected ServiceAccount token")
    c.add_argument("--out", required=True, help="file to write the enrollment token to (0600, replaced whole)")
    c.add_argument("--timeout-s", type=float, default=300.0, help="give up after this long")
    c.add_argument("--ca-file", default="", help="CA of an https:// enroller's certificate")
    c.add_argument("--server-name", default="", help="name its certificate must carry (default: the URL's host)")
    k = sub.add_parser("enrollment-keygen", help="make an enrollment key pair (bring your own to the chart)")
    k.add_argument("--out-dir", required=True, help="writes private.pem (0600) and public.pem here")


# --- the Kubernetes adapter ----------------------------------------------------------------

class KubeCluster:
    """`security.enroller.Cluster` through the `kubernetes` client (imported here only)."""

    def __init__(self, api_url: str = "", timeout_s: float = 5.0) -> None:
        from kubernetes import client, config

        if api_url:
            configuration = client.Configuration(host=api_url)
        else:
            configuration = client.Configuration()
            config.load_incluster_config(client_configuration=configuration)
        api = client.ApiClient(configuration)
        self._auth, self._core, self._client = client.AuthenticationV1Api(api), client.CoreV1Api(api), client
        self._timeout_s = timeout_s

    def review(self, token: str, audience: str):
        from pdserve.security.enroller import POD_NAME_EXTRA, POD_UID_EXTRA, Review

        body = self._client.V1TokenReview(spec=self._client.V1TokenReviewSpec(token=token, audiences=[audience]))
        status = self._call(self._auth.create_token_review, body).status
        user = status.user or self._client.V1UserInfo()
        extra = user.extra or {}
        first = lambda key: (extra.get(key) or [""])[0]  # noqa: E731
        return Review(authenticated=bool(status.authenticated), username=user.username or "",
                      audiences=tuple(status.audiences or ()), pod_name=first(POD_NAME_EXTRA),
                      pod_uid=first(POD_UID_EXTRA), error=status.error or "")

    def pod(self, namespace: str, name: str):
        from kubernetes.client.exceptions import ApiException

        from pdserve.security.enroller import Pod

        try:
            pod = self._call(self._core.read_namespaced_pod, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        meta, spec, status = pod.metadata, pod.spec, pod.status
        return Pod(name=meta.name, uid=meta.uid or "", namespace=meta.namespace or "",
                   service_account=spec.service_account_name or "", labels=dict(meta.labels or {}),
                   phase=status.phase or "", ip=status.pod_ip or "", deleting=meta.deletion_timestamp is not None)

    def _call(self, method, *args):
        from kubernetes.client.exceptions import ApiException

        try:
            return method(*args, _request_timeout=self._timeout_s)
        except ApiException as exc:
            if exc.status == 404:
                raise
            raise OSError(f"the Kubernetes API answered {exc.status} {exc.reason}") from None
        except Exception as exc:  # noqa: BLE001 - urllib3's errors, an answer that does not parse
            raise OSError(f"the Kubernetes API was not reached or not understood: {type(exc).__name__}: "
                          f"{str(exc)[:160]}") from None


# --- the HTTP endpoint ---------------------------------------------------------------------

class _Server(BoundedServer):
    def __init__(self, address, enroller, limit, max_connections: int, deadline_s: float) -> None:
        # a connection's deadline is its whole life: what a client that drips bytes sent before
        # the cut is not taken for a whole request
        super().__init__(address, _Handler, max_connections, deadline_s, io_timeout_s=5.0,
                         name="pdserve-enroller")
        self.enroller, self.limit = enroller, limit


class _Handler(BoundedHandler):
    protocol_version = "HTTP/1.0"
    server: _Server

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.client_address[0], *args)

    def do_GET(self) -> None:
        if self.expired.is_set():
            return
        if self.path == "/healthz":
            self._answer(200, {"status": "ok"})
        else:
            self._answer(404, {"error": f"no such path (POST {ENROLL_PATH})"})

    def do_POST(self) -> None:
        from pdserve.security.enroller import EnrollRefused

        if self.expired.is_set():
            return None
        if self.path != ENROLL_PATH:
            return self._answer(404, {"error": f"no such path (POST {ENROLL_PATH})"})
        length = self.headers.get("Content-Length") or "0"
        if not length.isdigit():
            return self._answer(400, {"error": "Content-Length is not a number"})
        if int(length) > 0:
            return self._answer(413, {"error": "an enrollment request has no body"})
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return self._answer(401, {"error": "send 'Authorization: Bearer <projected ServiceAccount token>'"})
        if not self.server.limit.try_take():
            return self._answer(429, {"error": "too many enrollments; retry"}, retry_after=1)
        try:
            issued, worker_id, role = self.server.enroller.enroll(token.strip())
        except EnrollRefused as exc:
            log.warning("enrollment refused to %s: %s", self.client_address[0], exc)
            return self._answer(403, {"error": str(exc)})
        except OSError as exc:
            log.error("enrollment: %s", exc)
            return self._answer(503, {"error": str(exc)}, retry_after=2)
        log.info("enrolled %s as %s", worker_id, role)
        self._answer(200, {"token": issued, "worker_id": worker_id, "role": role})

    def _answer(self, code: int, body: dict, retry_after: int = 0) -> None:
        headers = {"Cache-Control": "no-store"}
        if retry_after:
            headers["Retry-After"] = str(retry_after)
        self.reply(code, json.dumps(body).encode(), "application/json", headers)


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{what} {item!r}: write KEY=VALUE")
        out[key] = value
    return out


def serve(args: argparse.Namespace) -> int:
    from pdserve.security.enroller import Enroller, EnrollerPolicy, RateLimit
    from pdserve.security.enrollment import EnrollmentIssuer

    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        accounts = _pairs(args.role_account, "--role-account")
        if not accounts or set(accounts) - {"prefill", "decode"}:
            raise ValueError("--role-account: give prefill=SA and/or decode=SA")
        policy = EnrollerPolicy(args.namespace, args.audience, {sa: role for role, sa in accounts.items()},
                                _pairs(args.release_label, "--release-label"))
        issuer = EnrollmentIssuer.load(args.enrollment_key_file)
        cluster = KubeCluster(args.kube_api_url, args.api_timeout_s)
    except Exception as exc:  # noqa: BLE001 - any start-up failure is reported as one line
        print(f"pdserve enroller: {exc}", file=sys.stderr)
        return 2
    server = _Server((args.host, args.port), Enroller(issuer, policy, cluster),
                     RateLimit(args.rate, args.burst), args.max_connections, args.connection_deadline_s)
    scheme = "https" if args.tls_cert else "http"
    if args.tls_cert:
        import ssl

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(args.tls_cert, args.tls_key or None)
        # the handshake happens in the connection's own thread, under its socket deadline
        server.socket = context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    print(f"pdserve enroller ready {scheme}://{host}:{port} public key {issuer.public_key.hex()}", flush=True)
    stop.wait()
    server.shutdown()
    server.server_close()
    return 0


# --- the worker's side and the key ---------------------------------------------------------

class _Refused(Exception):
    """The enroller said no for good (a 4xx other than 429): retrying will not help."""


class _NamedHTTPS(http.client.HTTPSConnection):
    """HTTPS whose certificate must carry `server_name`, whatever host the URL names (the
    internal certificate carries one name for every service)."""

    def __init__(self, host: str, port: int, *, server_name: str, **kwargs: Any) -> None:
        super().__init__(host, port, **kwargs)
        self._server_name = server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self._server_name)


def _connection(url: str, timeout_s: float, ca_file: str, server_name: str) -> http.client.HTTPConnection:
    import ssl
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme == "http":
        return http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
    if parts.scheme != "https":
        raise ValueError(f"--enroller-url {url!r}: http:// or https://")
    context = ssl.create_default_context(cafile=ca_file or None)
    return _NamedHTTPS(parts.hostname, parts.port or 443, server_name=server_name or parts.hostname,
                       timeout=timeout_s, context=context)


def _ask(url: str, sa_token: str, timeout_s: float, ca_file: str = "", server_name: str = "") -> str:
    connection = _connection(url, timeout_s, ca_file, server_name)
    try:
        connection.request("POST", ENROLL_PATH, body=b"", headers={"Authorization": f"Bearer {sa_token}"})
        answer = connection.getresponse()
        raw = answer.read(MAX_ANSWER_BYTES)
    finally:
        connection.close()
    if answer.status != 200:
        reason = raw.decode("utf-8", "replace")
        if 400 <= answer.status < 500 and answer.status != 429:
            raise _Refused(f"the enroller refused ({answer.status}): {reason}")
        raise OSError(f"the enroller answered {answer.status}: {reason}")
    body = json.loads(raw)
    token = body.get("token") if isinstance(body, dict) else None
    if not isinstance(token, str) or not token.isprintable() or not token:
        raise OSError("the enroller's answer holds no token")
    return token


def enroll(args: argparse.Namespace) -> int:
    """Ask until the deadline; a refusal ends it at once (exit 2), the deadline with exit 1."""
    deadline = time.monotonic() + args.timeout_s
    wait_s, last = 0.5, "not asked yet"
    try:  # a URL or CA file that cannot work ends it now, not at the deadline
        _connection(args.enroller_url, 1.0, args.ca_file, args.server_name).close()
    except (ValueError, OSError) as exc:
        print(f"pdserve enroll: {exc}", file=sys.stderr)
        return 2
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            print(f"pdserve enroll: no enrollment token within {args.timeout_s:g} s: {last}", file=sys.stderr)
            return 1
        try:
            with open(args.service_account_token_file, encoding="ascii") as f:
                sa_token = f.read(16384).strip()
            token = _ask(args.enroller_url, sa_token, min(10.0, left), args.ca_file, args.server_name)
            write_private_file(args.out, (token + "\n").encode("ascii"))
            print(f"pdserve enroll: enrollment token written to {args.out}", flush=True)
            return 0
        except _Refused as exc:
            print(f"pdserve enroll: {exc}", file=sys.stderr)
            return 2
        except (OSError, ValueError, http.client.HTTPException) as exc:
            last = str(exc)
        time.sleep(max(0.0, min(wait_s, deadline - time.monotonic())))
        wait_s = min(5.0, wait_s * 2)


def keygen(args: argparse.Namespace) -> int:
    from pdserve.security.enrollment import EnrollmentIssuer

    issuer = EnrollmentIssuer()
    os.makedirs(args.out_dir, exist_ok=True)
    write_private_file(os.path.join(args.out_dir, "private.pem"), issuer.private_pem())
    with open(os.path.join(args.out_dir, "public.pem"), "wb") as f:
        f.write(issuer.public_pem())
    print(f"enrollment key pair in {args.out_dir}: private.pem (the enroller's), public.pem (the routers'); "
          f"public key {issuer.public_key.hex()}")
    return 0


def main(args: argparse.Namespace) -> int:
    return {"enroller": serve, "enroll": enroll, "enrollment-keygen": keygen}[args.command](args)

"""The gRPC adapter of internal authentication (DESIGN §7): it carries and checks what
`pdserve.security` decides.

Clients: `internal_channel(address, signer)` is a grpc.aio channel whose every call carries
a fresh credential (`pdserve-credential` metadata) made by a `security.credentials.CallSigner`.
Servers: `AuthInterceptor` asks the wing's `CallVerifier` and `check_role`, and refuses with
UNAUTHENTICATED, before the request is read (a refused call's message is never received,
whatever its size). Health checking and reflection stay open (probes). Each refusal is
counted and logged once per peer. Over mutual TLS, `PeerAddressInterceptor` applies the
wing's certificate-address rule (`security.internal_tls`).
"""
from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable

import grpc

from pdserve.common.errors import AuthError
from pdserve.common.util import is_loopback
from pdserve.rpc.errors import abort_grpc
from pdserve.rpc.server import CHANNEL_OPTIONS, refuse_unread
from pdserve.security.credentials import (AUDIENCE_HEADER, CREDENTIAL_HEADER, DIGEST_HEADER, MEMBER_HEADER, CallKey, CallSigner, CallVerifier,
                                          KeyDirectory, caller_of, check_role, is_bound, only_credential,
                                          request_digest)
from pdserve.security.internal_tls import (CertificateError, certificate_ip_addresses, check_peer_address,
                                           named_addresses, peer_address)
from pdserve.security.key_directory import PeerKeys
from pdserve.security.secret import (INSECURE_INTERNAL_OFF, ClusterSecret, ClusterSecretError, Mac, handoff_key,
                                     read_private_file, require_secret_off_loopback)

log = logging.getLogger("pdserve.auth")

_MAX_LOGGED_PEERS = 1024


def _with_credential(signer: CallSigner, details: grpc.aio.ClientCallDetails, address: str,
                     request) -> grpc.aio.ClientCallDetails:
    """`details` with a credential: for BOUND_SERVICES, bound to the server's `address` (as
    registered, which is what is dialed) and to the request's digest, sent beside it."""
    method = details.method.decode() if isinstance(details.method, bytes) else details.method
    metadata = list(details.metadata or ())
    if is_bound(method):
        digest = request_digest(request)
        credential = signer.credential(method, address, digest)
        metadata += [(DIGEST_HEADER, digest), (AUDIENCE_HEADER, address)]
    else:
        credential = signer.credential(method)
    metadata += [(CREDENTIAL_HEADER, credential), (MEMBER_HEADER, signer.member_proof(credential))]
    return grpc.aio.ClientCallDetails(details.method, details.timeout, grpc.aio.Metadata(*metadata),
                                      details.credentials, details.wait_for_ready)


# grpc.aio files an interceptor under one call kind only, hence one class per kind.
class _UnaryCredentials(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, signer: CallSigner, address: str) -> None:
        self._signer = signer
        self._address = address

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_credential(self._signer, details, self._address, request), request)


class _StreamCredentials(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, signer: CallSigner, address: str) -> None:
        self._signer = signer
        self._address = address

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_credential(self._signer, details, self._address, request), request)


INTERNAL_SERVER_NAME = "pdserve-internal"  # the name internal certificates carry (a SAN)


@dataclass(frozen=True)
class InternalTLS:
    """Mutual TLS between the services of one deployment: every server presents `cert`, every
    client presents it too, and each side accepts only certificates signed by `ca`. Two kinds
    of certificate:
    - the deployment's, naming INTERNAL_SERVER_NAME and no IP address: clients check a
      server's certificate against that name, not its address (pods come and go with new
      addresses; the deployment's certificate stays);
    - a host's, naming its IP addresses: clients check a server's certificate against the
      address they dial, and servers take its holder's calls only from the addresses it
      names (`PeerAddressInterceptor`)."""

    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)
    ca: bytes = field(repr=False)

    @classmethod
    def load(cls, cert_path: str, key_path: str, ca_path: str) -> "InternalTLS | None":
        paths = (cert_path, key_path, ca_path)
        if not any(paths):
            return None
        if not all(paths):
            raise ClusterSecretError("--internal-tls-cert, --internal-tls-key and --internal-tls-ca go together")
        try:
            cert, ca = open(cert_path, "rb").read(), open(ca_path, "rb").read()
        except OSError as exc:
            raise ClusterSecretError(f"cannot read internal TLS material: {exc}") from None
        # the key is checked as the cluster secret is: private to this user, read from one descriptor
        return cls(cert, read_private_file(key_path, "internal TLS key", max_bytes=1 << 20), ca)

    @functools.cached_property
    def addresses(self) -> tuple[str, ...]:
        """The IP addresses `cert` names (none: the deployment's certificate, or one grpc will
        refuse anyway because it does not parse)."""
        try:
            return certificate_ip_addresses(self.cert)
        except CertificateError:
            return ()

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def internal_channel(address: str, signer: CallSigner | None, tls: InternalTLS | None = None) -> grpc.aio.Channel:
    """A channel to another pdserve service; with a signer, every call carries a credential;
    with `tls`, it runs over mutual TLS, the server's certificate checked against the address
    dialed when `tls` is a host's (it names addresses), else against INTERNAL_SERVER_NAME."""
    interceptors = [_UnaryCredentials(signer, address), _StreamCredentials(signer, address)] \
        if signer is not None else None
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
    options = CHANNEL_OPTIONS
    if not tls.addresses:
        options += (("grpc.ssl_target_name_override", INTERNAL_SERVER_NAME),)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options,
                                   interceptors=interceptors)


def bind(server: grpc.aio.Server, address: str, tls: InternalTLS | None) -> int:
    """Listen on `address` (over mutual TLS when `tls`); the bound port, 0 when it failed."""
    try:
        if tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, tls.server_credentials())
    except RuntimeError:  # grpc's "Failed to bind": the caller says which port and whose
        return 0


def certificate_addresses(context: grpc.aio.ServicerContext) -> set:
    """The IP addresses the peer's verified certificate names (its IP SANs); empty without
    mutual TLS or for a certificate naming none."""
    return named_addresses(context.auth_context().get("x509_subject_alternative_name", ()))


def _guarded(handler: grpc.RpcMethodHandler, check) -> grpc.RpcMethodHandler:
    """`handler` with `await check(request, context)` run before its behaviour (which may abort)."""
    kind = ("stream" if handler.request_streaming else "unary") + "_" + \
        ("stream" if handler.response_streaming else "unary")
    behavior = getattr(handler, kind)

    async def unary(request, context):
        await check(request, context)
        return await behavior(request, context)

    async def streaming(request, context):
        await check(request, context)
        if inspect.isasyncgenfunction(behavior):
            async for item in behavior(request, context):
                yield item
        else:  # a coroutine that writes its responses with context.write
            await behavior(request, context)

    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(streaming if handler.response_streaming else unary,
                request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


def _one(metadata, name: str) -> str:
    """The one value of `name` a call carries ("" for none or several)."""
    found = [value for key, value in metadata or () if key == name]
    return found[0] if len(found) == 1 else ""


def _covering(handler: grpc.RpcMethodHandler, digest: str) -> grpc.RpcMethodHandler:
    """`handler`, refusing (UNAUTHENTICATED) a request whose digest is not the one its
    verified credential covers: a credential is good for its own request only."""
    async def check(request, context) -> None:
        if request_digest(request) != digest:
            err = AuthError("the request is not the one its credential covers")
            log.warning("refused an internal call from %s: %s", context.peer(), err)
            await abort_grpc(context, err)

    return _guarded(handler, check)


class PeerAddressInterceptor(grpc.aio.ServerInterceptor):
    """Over mutual TLS, a certificate that names IP addresses binds its holder to them: a call
    to a `protected` service from any other address is refused with UNAUTHENTICATED, saying
    which addresses the certificate names and where the call came from. A certificate that
    names no address (the deployment's, SAN INTERNAL_SERVER_NAME only) is taken from any."""

    def __init__(self, protected: Iterable[str], on_refused: Callable[[str], None] = lambda reason: None) -> None:
        self._protected = frozenset(protected)
        self._on_refused = on_refused

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.lstrip("/").split("/", 1)[0] not in self._protected:
            return handler
        return _guarded(handler, lambda _request, context: self._check(context))

    async def _check(self, context: grpc.aio.ServicerContext) -> None:
        try:
            check_peer_address(certificate_addresses(context), peer_address(context.peer() or ""))
        except AuthError as err:
            self._on_refused(str(err))
            log.warning("refused an internal call: %s", err)
            await abort_grpc(context, err)


def credentials_of(metadata) -> list[str]:
    """Every `pdserve-credential` value a call carries (a valid call carries exactly one)."""
    return [value for key, value in metadata or () if key == CREDENTIAL_HEADER]


def caller_id(context: grpc.aio.ServicerContext) -> str:
    """The caller id of the call's one credential, which the interceptor verified; "" when
    it carries none (an unprotected service). The interceptor refuses a call with several."""
    found = credentials_of(context.invocation_metadata())
    return caller_of(found[0]) if len(found) == 1 else ""


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to `protected` services (full names, e.g. "pdserve.v1.Decode") that carry
    no valid credential. `on_refused(reason)` counts refusals (a metric)."""

    def __init__(self, verifier: CallVerifier, protected: Iterable[str],
                 on_refused: Callable[[str], None] = lambda reason: None) -> None:
        self._verifier = verifier
        self._protected = frozenset(protected)
        self._on_refused = on_refused
        self._logged_peers: set[str] = set()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        service = details.method.lstrip("/").split("/", 1)[0]
        if service not in self._protected:
            return await continuation(details)
        try:
            credential = only_credential(credentials_of(details.invocation_metadata))
            digest, audience, proof = (_one(details.invocation_metadata, name)
                                       for name in (DIGEST_HEADER, AUDIENCE_HEADER, MEMBER_HEADER))
            check_role(await self._verifier.check_learning(details.method, credential, digest, audience, proof),
                       service)
        except AuthError as exc:
            self._on_refused(str(exc))
            return self._refusal(await continuation(details), exc)
        handler = await continuation(details)
        return _covering(handler, digest) if digest and handler is not None else handler

    def _refusal(self, handler: grpc.RpcMethodHandler | None, err: AuthError) -> grpc.RpcMethodHandler | None:
        def log_peer(context) -> None:  # once per peer, at most _MAX_LOGGED_PEERS of them
            peer = context.peer() or "unknown"
            if peer not in self._logged_peers and len(self._logged_peers) < _MAX_LOGGED_PEERS:
                self._logged_peers.add(peer)
                log.warning("refused an internal call from %s: %s", peer, err)

        return refuse_unread(handler, err, log_peer)


class InternalAuth:
    """A service's side of internal authentication: the cluster secret, this process's own
    call key (made here, never stored), signers for its outgoing calls, an interceptor for
    its incoming ones, and `peers`, a worker's directory of the keys that verify its callers
    (the router verifies with its registry's instead). Without a secret (loopback only, or
    --insecure-internal) all are absent and internal calls go unauthenticated."""

    def __init__(self, secret: ClusterSecret | None, tls: InternalTLS | None = None) -> None:
        self.secret = secret
        self.tls = tls
        self.key = CallKey() if secret is not None else None
        self.peers = PeerKeys()
        self._verifiers: list[CallVerifier] = []

    def serve_as(self, address: str) -> None:
        """This server is registered as `address`: signed calls to its workers' services must
        name it (security.credentials.BOUND_SERVICES)."""
        for verifier in self._verifiers:
            verifier.serve_as(address)

    @classmethod
    def from_settings(cls, role: str, host: str, secret_file: str, insecure_internal: bool,
                      tls: InternalTLS | None = None) -> "InternalAuth":
        """Load the secret; refuse to run beyond loopback without one (fail closed)."""
        secret = ClusterSecret.load(secret_file) if secret_file else None
        require_secret_off_loopback(host, secret, insecure_internal, role)
        if secret is None and not is_loopback(host):
            log.warning("%s: --insecure-internal on %s: without a cluster secret, %s", role, host, INSECURE_INTERNAL_OFF)
        elif secret is None:
            log.info("%s: no cluster secret; internal calls are unauthenticated (loopback only)", role)
        return cls(secret, tls)

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    @property
    def public_key(self) -> bytes:
        """What verifies this process's calls (b"" without a secret)."""
        return self.key.public_key if self.key is not None else b""

    def signer(self, caller_id: str) -> CallSigner | None:
        return CallSigner(self.secret, caller_id, self.key) if self.secret is not None else None

    def handoff_mac(self) -> Mac | None:
        """The MAC decodes sign hand-offs with and prefills check them with."""
        return Mac(handoff_key(self.secret)) if self.secret is not None else None

    def channel(self, address: str, caller_id: str) -> grpc.aio.Channel:
        """A channel whose calls carry `caller_id`'s credential (and run over mutual TLS)."""
        return internal_channel(address, self.signer(caller_id), self.tls)

    def interceptors(self, protected: Iterable[str], on_refused: Callable[[str], None],
                     keys: KeyDirectory | None = None) -> list:
        """The credential check (with a secret; callers' keys from `keys`, default `peers`),
        then the certificate's address (with mTLS)."""
        found: list = []
        if self.secret is not None:
            verifier = CallVerifier(self.secret, keys if keys is not None else self.peers)
            self._verifiers.append(verifier)
            found.append(AuthInterceptor(verifier, protected, on_refused))
        if self.tls is not None:
            found.append(PeerAddressInterceptor(protected, on_refused))
        return found

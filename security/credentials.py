"""Call keys and the credentials of internal calls (DESIGN §7).

Threat: anyone who reaches a service's internal port calls it as someone else (a decode
driving another decode, a stranger heartbeating as a worker), or replays a call captured on
the network; and a member holding the shared secret speaks as any other member.

Rule: every internal call carries exactly one credential, bound to the full gRPC method, the
caller id, the time and a nonce; it is accepted within `max_skew_s` of the verifier's clock,
once (a replay window keyed by nonce), and only from a role that may call that service
(`CALLER_ROLES`). Two kinds:

* `v1 <caller_id> <unix_ms> <nonce> <mac>`: an HMAC under the `calls` key, which every
  process of the deployment holds. It admits a process to the deployment, nothing more: it
  is accepted only for `ADMISSION_METHODS` (Register, ModelInfo, Load), and its caller id
  is a label anyone with the secret can write.
* `v2 <caller_id> <unix_ms> <nonce> <sig>`: an Ed25519 signature by the caller's own key
  (`CallKey`, made at start, never written down). Every other call needs one. A verifier
  finds the caller's public key in a `KeyDirectory`: the router in its registry (the
  registry binds a worker's key to its id with the lease), a worker in `key_directory`.

The router holds what verifies workers' calls, never what signs them. The gRPC side (the
interceptors that attach and check these) is an adapter in `pdserve.rpc.credentials`.
"""
from __future__ import annotations

import hashlib
import re
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Protocol, Sequence

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from pdserve.common.errors import AuthError
from pdserve.common.util import encode_fields
from pdserve.security.secret import ClusterSecret, Mac, calls_key

CREDENTIAL_HEADER = "pdserve-credential"
_CALLER_ID = re.compile(r"[A-Za-z0-9._:@/\[\]-]{1,200}")
_NONCE_BYTES = 16
PUBLIC_KEY_BYTES = 32  # a raw Ed25519 public key
_SIGNATURE_BYTES = 64
ROUTER_ID = "router"  # the caller id of every router; no worker may register under it
# The calls a v1 (cluster-secret) credential is enough for: joining, and reading what a
# worker serves and how loaded it is (the router asks a decode for ModelInfo before it
# answers its Register, so before that decode can know the router's key).
ADMISSION_METHODS = frozenset({
    "/pdserve.v1.Registry/Register",
    "/pdserve.v1.Decode/ModelInfo", "/pdserve.v1.Decode/Load",
    "/pdserve.v1.Prefill/ModelInfo", "/pdserve.v1.Prefill/Load",
})
# Who may call each internal service with their own signature: the router drives decodes,
# decodes drive prefills, workers keep their own registration, routers read workers' KV
# snapshots. A v1 (cluster-secret) credential carries no role; it is accepted for
# ADMISSION_METHODS only.
CALLER_ROLES = {
    "pdserve.v1.Decode": frozenset({"router"}),
    "pdserve.v1.Prefill": frozenset({"decode"}),
    "pdserve.v1.Registry": frozenset({"prefill", "decode"}),
    "pdserve.v1.KVEvents": frozenset({"router"}),
    "pdserve.v1.Adapters": frozenset({"router"}),  # LoRA administration: the router's admin endpoints
}


class UnknownCallerError(AuthError):
    """A v2 credential whose caller has no key here that verifies it (yet): the verifier's
    `KeyDirectory` may learn the key (`refresh`) and the check be tried once more. The
    message is the same for every caller (refusal reasons are metric labels)."""

    def __init__(self, message: str, caller_id: str) -> None:
        super().__init__(message)
        self.caller_id = caller_id


class CallKey:
    """This process's Ed25519 key pair, made at start. The private key never leaves the
    process: it is not written anywhere and not shown by repr."""

    def __init__(self) -> None:
        self._private = Ed25519PrivateKey.generate()
        self.public_key = self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def __repr__(self) -> str:
        return f"CallKey(public={self.public_key.hex()[:16]}...)"

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)


@lru_cache(maxsize=4096)
def public_key_of(raw: bytes) -> Ed25519PublicKey:
    """A loaded public key (loading costs more than a verify; keys are few and reused).
    ValueError unless `raw` is PUBLIC_KEY_BYTES long."""
    if len(raw) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes, not {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who made a verified call: a caller id, its role ("router", "prefill", "decode"; "" for
    a v1 credential, which proves membership of the deployment only) and its public key."""

    caller_id: str
    role: str
    public_key: bytes = field(default=b"", repr=False)


class KeyDirectory(Protocol):
    """Where a verifier finds callers' public keys.

    `identities(caller_id)` answers from memory, at once: the identities that caller id may
    hold now (several for ROUTER_ID when several routers run). `refresh(caller_id)` is
    awaited after a credential of `caller_id` failed to verify with them, before the one
    retry: it may learn keys (bounded in time and rate), or do nothing."""

    def identities(self, caller_id: str) -> Sequence[Identity]: ...

    async def refresh(self, caller_id: str) -> None: ...


def check_role(identity: Identity, service: str) -> None:
    """AuthError unless `identity`'s role may call `service` (a full service name). A v1
    identity has no role: what it may call is decided by ADMISSION_METHODS instead."""
    roles = CALLER_ROLES.get(service)
    if identity.role and roles is not None and identity.role not in roles:
        raise AuthError(f"a {identity.role} may not call {service}")


# The services whose calls are bound to the server called (its registered address) and to the
# request message: a credential for one worker is good at no other, for no other request.
BOUND_SERVICES = frozenset({"pdserve.v1.Decode", "pdserve.v1.Prefill", "pdserve.v1.KVEvents",
                            "pdserve.v1.Adapters"})
DIGEST_HEADER = "pdserve-request-digest"  # the hex SHA-256 of the request a v2 credential covers
AUDIENCE_HEADER = "pdserve-audience"  # the address of the server a v2 credential is for
# A member's proof beside a v2 credential: the cluster secret's MAC over its nonce. Cheap to
# check, it is what a caller whose key is not known here must show before the verifier looks
# its key up (an outsider's made-up caller ids cost a MAC, never a lookup).
MEMBER_HEADER = "pdserve-member"


def request_digest(request) -> str:
    """The digest a credential of `request` (a proto message) covers: SHA-256 of its
    deterministic encoding, in hex."""
    return hashlib.sha256(request.SerializeToString(deterministic=True)).hexdigest()


def is_bound(method: str) -> bool:
    return method.lstrip("/").split("/", 1)[0] in BOUND_SERVICES


def _signed_text(method: str, caller: str, unix_ms: int, nonce: str, audience: str = "", digest: str = "") -> bytes:
    return encode_fields("pdserve-call-v3", method, caller, unix_ms, nonce, audience, digest)


class CallSigner:
    """Makes the credential a caller attaches to one internal RPC: v1 (the cluster secret's
    MAC) for ADMISSION_METHODS or when it has no `key`, else v2 (its own signature)."""

    def __init__(self, secret: ClusterSecret, caller_id: str, key: CallKey | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if not _CALLER_ID.fullmatch(caller_id):
            raise ValueError(f"caller id {caller_id!r} has characters a credential cannot carry")
        self._mac = Mac(calls_key(secret))
        self._key = key
        self.caller_id = caller_id
        self._clock = clock

    @property
    def public_key(self) -> bytes:
        """What verifies this signer's v2 credentials (b"": it makes v1 ones only)."""
        return self._key.public_key if self._key is not None else b""

    def member_proof(self, credential: str) -> str:
        """MEMBER_HEADER's value beside `credential` (one of ours): the MAC over its nonce."""
        return self._mac.tag("pdserve-member", credential.split(" ")[3]).hex()

    def credential(self, method: str, audience: str = "", digest: str = "") -> str:
        """A credential for one call of `method`; a v2 one also covers `audience` (the
        address of the server called, for BOUND_SERVICES) and `digest` (`request_digest` of
        the request, sent beside it as DIGEST_HEADER)."""
        unix_ms = int(self._clock() * 1000)
        nonce = secrets.token_hex(_NONCE_BYTES)
        if self._key is None or method in ADMISSION_METHODS:
            mac = self._mac.tag(method, self.caller_id, unix_ms, nonce).hex()
            return f"v1 {self.caller_id} {unix_ms} {nonce} {mac}"
        signature = self._key.sign(_signed_text(method, self.caller_id, unix_ms, nonce, audience, digest)).hex()
        return f"v2 {self.caller_id} {unix_ms} {nonce} {signature}"


def caller_of(credential: str | None) -> str:
    """The caller id a (verified) credential names; "" if it names none."""
    parts = (credential or "").split(" ")
    return parts[1] if len(parts) == 5 else ""


def only_credential(found: Sequence[str]) -> str | None:
    """The one credential a call carries (None: it carries none); AuthError when it carries
    several (the one verified must be the one whose caller id is used)."""
    if len(found) > 1:
        raise AuthError(f"a call carries exactly one {CREDENTIAL_HEADER}, not {len(found)}")
    return found[0] if found else None


class ReplayWindow:
    """The nonces accepted within the skew window, each accepted once. Bounded: when
    `max_remembered` live nonces are held, new credentials are refused rather than a live
    nonce forgotten; with `max_per_caller`, one caller's live nonces are bounded too, so a
    caller filling its quota is refused alone and leaves room for every other one."""

    def __init__(self, ttl_s: float, max_remembered: int, max_per_caller: int | None = None) -> None:
        self._ttl_s = ttl_s
        self._max_remembered = max_remembered
        self._max_per_caller = max_per_caller or max_remembered
        self._seen: OrderedDict[str, tuple[float, str]] = OrderedDict()  # nonce -> (expiry, caller), oldest first
        self._per_caller: dict[str, int] = {}
        self._lock = threading.Lock()

    def remember(self, nonce: str, now: float, caller: str = "") -> None:
        """AuthError if `nonce` was accepted before (or the window, or `caller`'s quota in
        it, is full)."""
        with self._lock:
            while self._seen and next(iter(self._seen.values()))[0] < now:
                _, (_, old) = self._seen.popitem(last=False)  # expired: outside the skew window anyway
                if (left := self._per_caller[old] - 1) > 0:
                    self._per_caller[old] = left
                else:
                    del self._per_caller[old]
            if nonce in self._seen:
                raise AuthError("replayed credential")
            if len(self._seen) >= self._max_remembered:
                raise AuthError("too many credentials in the skew window")
            if self._per_caller.get(caller, 0) >= self._max_per_caller:
                raise AuthError("too many credentials of this caller in the skew window")
            self._seen[nonce] = (now + self._ttl_s, caller)
            self._per_caller[caller] = self._per_caller.get(caller, 0) + 1


_TAG_HEX = {"v1": 64, "v2": 2 * _SIGNATURE_BYTES}
MAX_CALLER_SHARE = 4  # one signed caller holds at most 1/4 of a verifier's replay window


class CallVerifier:
    """Checks call credentials: MAC or signature, clock skew, and that no nonce is accepted
    twice. With `keys`, v2 credentials verify against the caller's keys found there and v1
    ones only for ADMISSION_METHODS; without (unit tests, a process that learns no keys),
    only v1 credentials verify, for any method."""

    def __init__(self, secret: ClusterSecret, keys: KeyDirectory | None = None, *, max_skew_s: float = 60.0,
                 max_remembered: int = 200_000, clock: Callable[[], float] = time.time) -> None:
        self._mac = Mac(calls_key(secret))
        self.keys = keys
        self.max_skew_s = max_skew_s
        self._clock = clock
        # v1 (admission) credentials name any caller id their maker likes: they share one
        # window, apart from the signed (v2) ones, where each verified caller has a quota, so
        # neither a flood of admissions nor one worker's calls crowd out another's heartbeats.
        self._admissions = ReplayWindow(2 * max_skew_s, max_remembered)
        self._replays = ReplayWindow(2 * max_skew_s, max_remembered, max(1, max_remembered // MAX_CALLER_SHARE))
        # The address this server is registered under (`serve_as`): once set, a v2 credential
        # for one of BOUND_SERVICES must name it and cover its request's digest.
        self.audience = ""

    def serve_as(self, address: str) -> None:
        self.audience = address

    def verify(self, method: str, credential: str | None, digest: str = "", audience: str = "") -> str:
        """The caller id of a valid credential for `method`; AuthError otherwise."""
        return self.check(method, credential, digest, audience).caller_id

    def check(self, method: str, credential: str | None, digest: str = "", audience: str = "") -> Identity:
        """The identity of a valid credential for `method` covering `digest` and `audience`
        (the request's digest and the server's address, as the call claims them; a server
        that `serve_as` an address takes a call to a BOUND_SERVICE only for it, with a
        digest): AuthError otherwise, its subclass UnknownCallerError when no key known here
        verifies a well-formed v2 credential."""
        if not credential:
            raise AuthError("no credential")
        parts = credential.split(" ")
        if len(parts) != 5 or parts[0] not in _TAG_HEX or (parts[0] == "v2" and self.keys is None):
            raise AuthError("malformed credential")
        kind, caller, unix_ms, nonce, tag_hex = parts
        if not (_CALLER_ID.fullmatch(caller) and unix_ms.isdigit() and len(unix_ms) <= 16
                and len(nonce) == 2 * _NONCE_BYTES and len(tag_hex) == _TAG_HEX[kind]):
            raise AuthError("malformed credential")
        try:
            tag = bytes.fromhex(tag_hex)
        except ValueError:
            raise AuthError("malformed credential") from None
        now = self._clock()
        in_window = abs(now - int(unix_ms) / 1000) <= self.max_skew_s
        if kind == "v1":
            identity = self._check_admission(method, caller, int(unix_ms), nonce, tag)
        if not in_window:  # before a signature check: a stale credential costs no verify
            raise AuthError("credential outside the clock-skew window")
        if kind == "v2":
            if self.audience and is_bound(method):
                if audience != self.audience:
                    raise AuthError("the credential is for another server")
                if len(digest) != 64:
                    raise AuthError("a call to a worker must cover its request (pdserve-request-digest)")
            identity = self._check_signature(method, caller, int(unix_ms), nonce, tag, audience, digest)
            self._replays.remember(nonce, now, identity.caller_id)
        else:
            self._admissions.remember(nonce, now)
        return identity

    def _check_admission(self, method: str, caller: str, unix_ms: int, nonce: str, mac: bytes) -> Identity:
        if not self._mac.check(mac, method, caller, unix_ms, nonce):
            raise AuthError("bad credential")
        if self.keys is not None and method not in ADMISSION_METHODS:
            raise AuthError("a v1 credential admits to registration, ModelInfo and Load only; "
                            "this call needs the caller's own signature (v2)")
        return Identity(caller, "")

    def _check_signature(self, method: str, caller: str, unix_ms: int, nonce: str, signature: bytes,
                         audience: str, digest: str) -> Identity:
        text = _signed_text(method, caller, unix_ms, nonce, audience, digest)
        for identity in self.keys.identities(caller):
            try:
                public_key_of(identity.public_key).verify(signature, text)
            except (InvalidSignature, ValueError):
                continue
            return identity
        raise UnknownCallerError("no key known here verifies the caller's signature", caller)

    async def check_learning(self, method: str, credential: str | None, digest: str = "",
                             audience: str = "", member_proof: str = "") -> Identity:
        """`check`, and for a caller whose key is not known here yet one more try after the
        directory's refresh (a peer that just joined or restarted), only when the call shows
        `member_proof` (MEMBER_HEADER: the cluster secret's MAC over its nonce)."""
        try:
            return self.check(method, credential, digest, audience)
        except UnknownCallerError as exc:
            if not self._is_member(credential, member_proof):
                raise AuthError("an unknown caller's call must prove membership before its key is looked up") from None
            await self.keys.refresh(exc.caller_id)
        return self.check(method, credential, digest, audience)

    def _is_member(self, credential: str | None, proof: str) -> bool:
        try:
            tag = bytes.fromhex(proof)
        except ValueError:
            return False
        return len(tag) == 32 and self._mac.check(tag, "pdserve-member", (credential or "").split(" ")[3])

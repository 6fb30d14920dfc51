"""pdserve's typed errors and the one table that gives each a wire meaning.

Code everywhere raises a typed error (`InvalidRequestError`, `CapacityError`, ...), with the
offending request field (`param`), an OpenAI error code or a retry delay when it has one.
Edges convert any exception with `to_service_error` and speak the wire from the table:
an HTTP status and OpenAI error JSON at the router's HTTP front, a gRPC status code
(by name: this module imports no grpc; `pdserve.rpc.errors` turns names into
`grpc.StatusCode`) on every gRPC server, and a label for request-outcome metrics.

    raise InvalidRequestError("temperature must be in [0, 2]", param="temperature")

`ServiceError` is the wire form: the edges make it (`to_service_error`, `ServiceError.from_grpc`
for a peer's status); nothing else raises it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterable


# -- typed errors raised below the edges -----------------------------------------------------
class PdserveError(Exception):
    """Base of every error pdserve raises on purpose. `param`: the offending request field;
    `code`: the OpenAI error code, when not the table's; `retry_after_s`: when to try again."""

    def __init__(self, message: str = "", *, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def kind(self) -> "ErrorKind":
        """Its row of the wire table."""
        return to_service_error(self).kind

    @property
    def message(self) -> str:
        return str(self)


class InvalidRequestError(PdserveError, ValueError):
    """The request itself is wrong (empty prompt, bad sampling value, too long...)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the tokens asked for) does not fit the model's context."""


class PayloadTooLargeError(InvalidRequestError):
    """The request body is over the size limit."""


class NotFoundError(PdserveError):
    """An unknown model or worker."""


class LoraAdapterError(InvalidRequestError):
    """A LoRA adapter that cannot be served on this model: missing files, a rank over the
    limit, target modules the model lacks, shapes that disagree, a path outside the root."""


class LoraNotFoundError(NotFoundError):
    """A request or an unload names an adapter this engine has not loaded."""


class LoraInUseError(PdserveError):
    """An adapter cannot be unloaded while requests use it (they must finish first)."""


class AlreadyExistsError(PdserveError):
    """The id is taken: a request id in flight, a worker id alive elsewhere."""


class UnauthenticatedError(PdserveError):
    """A client's API key is missing or wrong."""


class UnavailableError(PdserveError):
    """No worker can serve this now."""


class ModelLoadError(PdserveError):
    """The model could not be found or read (unknown path, corrupt file, unsupported arch)."""


class CapacityError(PdserveError):
    """The KV cache can never hold this request, whatever else finishes."""


class OverloadedError(PdserveError):
    """A queue bound is reached now; the same request may succeed later."""


class IncompatiblePeerError(PdserveError):
    """A peer runs another model or layout (compatibility hash, block size)."""


class RequestAbortedError(PdserveError):
    """The request was aborted before it finished."""


class DeadlinePassedError(PdserveError, TimeoutError):
    """A deadline the request carried (or a wait of ours) ran out."""


class TransferError(PdserveError):
    """A KV transfer failed (refused, corrupt, timed out, peer gone)."""


class UpstreamFailedError(PdserveError):
    """A worker's own peer (decode's prefill leg) failed and the policy is to fail."""


class AuthError(PdserveError):
    """A credential, signature or MAC is missing or does not verify. The message names the
    reason, never the secret or the expected value."""


# -- the wire table ------------------------------------------------------------------------
class ErrorKind(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"  # the request is wrong; retrying will not help
    NOT_FOUND = "not_found"  # unknown model, unknown worker
    UNAUTHENTICATED = "unauthenticated"  # credential missing or wrong
    PAYLOAD_TOO_LARGE = "payload_too_large"  # request body over the limit
    ALREADY_EXISTS = "already_exists"  # a request id already in flight
    FAILED_PRECONDITION = "failed_precondition"  # incompatible peer (compatibility hash, block size)
    RATE_LIMITED = "rate_limited"  # queue bound reached; retry after a while
    UNAVAILABLE = "unavailable"  # no worker can serve now, or a peer is gone
    DEADLINE_EXCEEDED = "deadline_exceeded"  # a wait ran past its deadline
    CANCELLED = "cancelled"  # aborted by the client or an Abort
    INTERNAL = "internal"  # a bug or an unexpected failure
    UPSTREAM_FAILED = "upstream_failed"  # a worker's peer (the prefill leg) failed under policy "fail"


@dataclass(frozen=True, slots=True)
class WireMapping:
    grpc_code: str  # name of a grpc.StatusCode member
    http_status: int
    openai_type: str  # OpenAI error "type"
    openai_code: str | None  # OpenAI error "code" unless the error names its own
    outcome: str  # label of request-outcome metrics


_TABLE: dict[ErrorKind, WireMapping] = {
    ErrorKind.INVALID_ARGUMENT: WireMapping("INVALID_ARGUMENT", 400, "invalid_request_error", None, "invalid"),
    ErrorKind.NOT_FOUND: WireMapping("NOT_FOUND", 404, "invalid_request_error", "model_not_found", "not_found"),
    ErrorKind.UNAUTHENTICATED: WireMapping("UNAUTHENTICATED", 401, "invalid_request_error", "invalid_api_key", "unauthenticated"),
    ErrorKind.PAYLOAD_TOO_LARGE: WireMapping("INVALID_ARGUMENT", 413, "invalid_request_error", "payload_too_large", "invalid"),
    ErrorKind.ALREADY_EXISTS: WireMapping("ALREADY_EXISTS", 409, "invalid_request_error", "conflict", "invalid"),
    ErrorKind.FAILED_PRECONDITION: WireMapping("FAILED_PRECONDITION", 400, "invalid_request_error", None, "invalid"),
    ErrorKind.RATE_LIMITED: WireMapping("RESOURCE_EXHAUSTED", 429, "rate_limit_error", "rate_limit_exceeded", "rate_limited"),
    ErrorKind.UNAVAILABLE: WireMapping("UNAVAILABLE", 503, "server_error", "service_unavailable", "unavailable"),
    ErrorKind.DEADLINE_EXCEEDED: WireMapping("DEADLINE_EXCEEDED", 504, "server_error", "timeout", "timeout"),
    ErrorKind.CANCELLED: WireMapping("CANCELLED", 499, "invalid_request_error", "cancelled", "aborted"),
    ErrorKind.INTERNAL: WireMapping("INTERNAL", 500, "server_error", "internal_error", "error"),
    ErrorKind.UPSTREAM_FAILED: WireMapping("ABORTED", 502, "server_error", "prefill_failed", "error"),
}

# A peer's status code name -> kind (the inverse of the table; INVALID_ARGUMENT stays 400).
_FROM_GRPC: dict[str, ErrorKind] = {
    "INVALID_ARGUMENT": ErrorKind.INVALID_ARGUMENT,
    "OUT_OF_RANGE": ErrorKind.INVALID_ARGUMENT,
    "NOT_FOUND": ErrorKind.NOT_FOUND,
    "UNAUTHENTICATED": ErrorKind.UNAUTHENTICATED,
    "PERMISSION_DENIED": ErrorKind.UNAUTHENTICATED,
    "ALREADY_EXISTS": ErrorKind.ALREADY_EXISTS,
    "FAILED_PRECONDITION": ErrorKind.FAILED_PRECONDITION,
    "RESOURCE_EXHAUSTED": ErrorKind.RATE_LIMITED,
    "UNAVAILABLE": ErrorKind.UNAVAILABLE,
    "DEADLINE_EXCEEDED": ErrorKind.DEADLINE_EXCEEDED,
    "CANCELLED": ErrorKind.CANCELLED,
    "ABORTED": ErrorKind.UPSTREAM_FAILED,
}

# typed error -> (kind, OpenAI code), most specific first
_KIND_OF: tuple[tuple[type[BaseException], ErrorKind, str | None], ...] = (
    (PromptTooLongError, ErrorKind.INVALID_ARGUMENT, "context_length_exceeded"),
    (PayloadTooLargeError, ErrorKind.PAYLOAD_TOO_LARGE, None),
    (InvalidRequestError, ErrorKind.INVALID_ARGUMENT, None),
    (NotFoundError, ErrorKind.NOT_FOUND, None),
    (AlreadyExistsError, ErrorKind.ALREADY_EXISTS, None),
    (UnauthenticatedError, ErrorKind.UNAUTHENTICATED, None),
    (UnavailableError, ErrorKind.UNAVAILABLE, None),
    (CapacityError, ErrorKind.INVALID_ARGUMENT, "kv_capacity_exceeded"),
    (OverloadedError, ErrorKind.RATE_LIMITED, None),
    (IncompatiblePeerError, ErrorKind.FAILED_PRECONDITION, None),
    (LoraInUseError, ErrorKind.FAILED_PRECONDITION, "adapter_in_use"),
    (RequestAbortedError, ErrorKind.CANCELLED, None),
    (TransferError, ErrorKind.UNAVAILABLE, None),
    (ModelLoadError, ErrorKind.UNAVAILABLE, None),
    (UpstreamFailedError, ErrorKind.UPSTREAM_FAILED, None),
    (AuthError, ErrorKind.UNAUTHENTICATED, "invalid_credential"),
    (TimeoutError, ErrorKind.DEADLINE_EXCEEDED, None),  # DeadlinePassedError, asyncio.TimeoutError
)

PARAM_METADATA_KEY = "pdserve-error-param"
RETRY_AFTER_METADATA_KEY = "retry-after"


def wire(kind: ErrorKind) -> WireMapping:
    return _TABLE[kind]


class ServiceError(Exception):
    """An error with a wire meaning. `param` names the offending request field;
    `code` overrides the OpenAI error code (e.g. "context_length_exceeded")."""

    def __init__(self, kind: ErrorKind, message: str, *, param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def __repr__(self) -> str:
        return f"ServiceError({self.kind.name}, {self.message!r}, param={self.param!r})"

    @property
    def grpc_code(self) -> str:
        """Name of the grpc.StatusCode member."""
        return _TABLE[self.kind].grpc_code

    @property
    def http_status(self) -> int:
        return _TABLE[self.kind].http_status

    @property
    def outcome(self) -> str:
        return _TABLE[self.kind].outcome

    def openai_body(self) -> dict[str, Any]:
        """`{"error": {"message", "type", "param", "code"}}` as OpenAI sends it."""
        mapping = _TABLE[self.kind]
        return {"error": {"message": self.message, "type": mapping.openai_type,
                          "param": self.param, "code": self.code or mapping.openai_code}}

    def http_headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}

    def grpc_trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        pairs = []
        if self.param:
            pairs.append((PARAM_METADATA_KEY, self.param))
        if self.retry_after_s is not None:
            pairs.append((RETRY_AFTER_METADATA_KEY, str(self.retry_after_s)))
        return tuple(pairs)

    @classmethod
    def from_grpc(cls, code_name: str, details: str,
                  trailing_metadata: Iterable[tuple[str, Any]] = ()) -> "ServiceError":
        """A peer's status (code given by name) as a ServiceError; unknown codes are INTERNAL."""
        meta = {k: v for k, v in (trailing_metadata or ())}
        retry = meta.get(RETRY_AFTER_METADATA_KEY)
        return cls(_FROM_GRPC.get(code_name, ErrorKind.INTERNAL), details or code_name,
                   param=meta.get(PARAM_METADATA_KEY) or None,
                   retry_after_s=int(retry) if retry and str(retry).isdigit() else None)


# what a service raises on purpose: typed errors, and a peer's status as its wire form
EXPECTED_ERRORS = (PdserveError, ServiceError)


def to_service_error(exc: BaseException) -> ServiceError:
    """Any exception as a ServiceError: typed pdserve errors keep their meaning, a gRPC error
    from a peer keeps its status; anything else is INTERNAL (a bug)."""
    if isinstance(exc, ServiceError):
        return exc
    code = getattr(exc, "code", None)
    if callable(code) and callable(getattr(exc, "details", None)):  # a grpc.RpcError from a peer
        return ServiceError.from_grpc(code().name, exc.details() or "", exc.trailing_metadata())
    for kind_type, kind, openai_code in _KIND_OF:
        if isinstance(exc, kind_type):
            return ServiceError(kind, str(exc) or kind.value, param=getattr(exc, "param", None),
                                code=getattr(exc, "code", None) or openai_code,
                                retry_after_s=getattr(exc, "retry_after_s", None))
    return ServiceError(ErrorKind.INTERNAL, f"internal error ({type(exc).__name__})")

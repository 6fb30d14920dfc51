"""The one table that maps pdserve's typed errors onto gRPC status codes, HTTP statuses and
OpenAI's error JSON. Every edge (router HTTP and gRPC, prefill and decode servicers) raises
or converts to `ServiceError` and lets this module speak the wire.

    raise ServiceError(ErrorKind.INVALID_ARGUMENT, "temperature must be in [0, 2]", param="temperature")

gRPC: `await abort_grpc(context, err)` ends the call with the kind's status code; the
offending field travels in trailing metadata `pdserve-error-param`, a retry delay in
`retry-after` (seconds). `ServiceError.from_rpc_error` reverses that on the calling side,
so a worker's INVALID_ARGUMENT reaches an HTTP client as a 400.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

log = logging.getLogger("pdserve.errors")

PARAM_METADATA_KEY = "pdserve-error-param"
RETRY_AFTER_METADATA_KEY = "retry-after"


class ErrorKind(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"  # the request is wrong; retrying will not help
    NOT_FOUND = "not_found"  # unknown model, unknown worker
    UNAUTHENTICATED = "unauthenticated"  # API key missing or wrong
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
    grpc_code: grpc.StatusCode
    http_status: int
    openai_type: str  # OpenAI error "type"
    openai_code: str | None  # OpenAI error "code" unless the error names its own
    outcome: str  # label of request-outcome metrics


_TABLE: dict[ErrorKind, WireMapping] = {
    ErrorKind.INVALID_ARGUMENT: WireMapping(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", None, "invalid"),
    ErrorKind.NOT_FOUND: WireMapping(grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error", "model_not_found", "not_found"),
    ErrorKind.UNAUTHENTICATED: WireMapping(grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_request_error", "invalid_api_key", "unauthenticated"),
    ErrorKind.PAYLOAD_TOO_LARGE: WireMapping(grpc.StatusCode.INVALID_ARGUMENT, 413, "invalid_request_error", "payload_too_large", "invalid"),
    ErrorKind.ALREADY_EXISTS: WireMapping(grpc.StatusCode.ALREADY_EXISTS, 409, "invalid_request_error", "conflict", "invalid"),
    ErrorKind.FAILED_PRECONDITION: WireMapping(grpc.StatusCode.FAILED_PRECONDITION, 400, "invalid_request_error", None, "invalid"),
    ErrorKind.RATE_LIMITED: WireMapping(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "rate_limit_exceeded", "rate_limited"),
    ErrorKind.UNAVAILABLE: WireMapping(grpc.StatusCode.UNAVAILABLE, 503, "server_error", "service_unavailable", "unavailable"),
    ErrorKind.DEADLINE_EXCEEDED: WireMapping(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "server_error", "timeout", "timeout"),
    ErrorKind.CANCELLED: WireMapping(grpc.StatusCode.CANCELLED, 499, "invalid_request_error", "cancelled", "aborted"),
    ErrorKind.INTERNAL: WireMapping(grpc.StatusCode.INTERNAL, 500, "server_error", "internal_error", "error"),
    ErrorKind.UPSTREAM_FAILED: WireMapping(grpc.StatusCode.ABORTED, 502, "server_error", "prefill_failed", "error"),
}

# A peer's status code -> kind (the inverse of the table; INVALID_ARGUMENT stays 400).
_FROM_GRPC: dict[grpc.StatusCode, ErrorKind] = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorKind.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE: ErrorKind.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND: ErrorKind.NOT_FOUND,
    grpc.StatusCode.UNAUTHENTICATED: ErrorKind.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: ErrorKind.UNAUTHENTICATED,
    grpc.StatusCode.ALREADY_EXISTS: ErrorKind.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION: ErrorKind.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorKind.RATE_LIMITED,
    grpc.StatusCode.UNAVAILABLE: ErrorKind.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorKind.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED: ErrorKind.CANCELLED,
    grpc.StatusCode.ABORTED: ErrorKind.UPSTREAM_FAILED,
}


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
    def grpc_code(self) -> grpc.StatusCode:
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
    def from_grpc(cls, code: grpc.StatusCode, details: str,
                  trailing_metadata: Any = ()) -> "ServiceError":
        """A peer's status as a ServiceError (unknown codes become INTERNAL)."""
        meta = {k: v for k, v in (trailing_metadata or ())}
        retry = meta.get(RETRY_AFTER_METADATA_KEY)
        return cls(_FROM_GRPC.get(code, ErrorKind.INTERNAL), details or code.name,
                   param=meta.get(PARAM_METADATA_KEY) or None,
                   retry_after_s=int(retry) if retry and str(retry).isdigit() else None)

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> "ServiceError":
        return cls.from_grpc(err.code(), err.details() or "", err.trailing_metadata())


def to_service_error(exc: BaseException) -> ServiceError:
    """Any exception as a ServiceError: typed pdserve errors keep their meaning; anything
    else is INTERNAL (a bug), with the exception's type in the message."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return ServiceError.from_rpc_error(exc)
    # The engine's typed errors (a torch-free module), checked most specific first.
    from pdserve.engine import errors as engine_errors

    if isinstance(exc, engine_errors.PromptTooLongError):
        return ServiceError(ErrorKind.INVALID_ARGUMENT, str(exc), code="context_length_exceeded")
    if isinstance(exc, (engine_errors.InvalidRequestError, engine_errors.CapacityError)):
        return ServiceError(ErrorKind.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, engine_errors.RequestAbortedError):
        return ServiceError(ErrorKind.CANCELLED, str(exc) or "aborted")
    if isinstance(exc, engine_errors.TransferError):
        return ServiceError(ErrorKind.UNAVAILABLE, f"KV transfer failed: {exc}")
    if isinstance(exc, TimeoutError):
        return ServiceError(ErrorKind.DEADLINE_EXCEEDED, str(exc) or "timed out")
    return ServiceError(ErrorKind.INTERNAL, f"{type(exc).__name__}: {exc}")


async def abort_grpc(context: Any, err: BaseException) -> NoReturn:
    """End a grpc.aio call with `err`'s status (never returns)."""
    service_error = to_service_error(err)
    if service_error.kind is ErrorKind.INTERNAL:
        log.error("internal error: %s", service_error.message, exc_info=err)
    await context.abort(service_error.grpc_code, service_error.message,
                        trailing_metadata=service_error.grpc_trailing_metadata())
    raise AssertionError("context.abort returned")  # pragma: no cover

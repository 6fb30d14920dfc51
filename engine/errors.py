"""Typed errors raised by the engine. Edges map them to HTTP 4xx / gRPC status codes."""


class PdserveError(Exception):
    """Base of every error pdserve raises on purpose."""


class InvalidRequestError(PdserveError, ValueError):
    """The request itself is wrong (empty prompt, bad sampling value, too long...)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the tokens asked for) does not fit the model's context."""


class ModelLoadError(PdserveError):
    """The model could not be found or read (unknown path, corrupt file, unsupported arch)."""


class CapacityError(PdserveError):
    """The KV cache can never hold this request, whatever else finishes."""


class RequestAbortedError(PdserveError):
    """The request was aborted before it finished."""


class TransferError(PdserveError):
    """A KV transfer failed (refused, corrupt, timed out, peer gone)."""

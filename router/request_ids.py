"""Request ids. The router assigns the id every service acts on; an id a client chooses
(gRPC GenerateRequest.request_id) is only a label: echoed in its responses, the key of its
owner's Abort, never sent to a worker.

    request_id = new_request_id()             # "req-" + 128 random bits in hex
    label = check_label(request.request_id)   # or INVALID_ARGUMENT
"""
from __future__ import annotations

import secrets

from pdserve.common.errors import InvalidRequestError

MAX_LABEL_CHARS = 64


def new_request_id(prefix: str = "req") -> str:
    """A fresh id no client can predict or choose."""
    return f"{prefix}-{secrets.token_hex(16)}"


def check_label(value: str, param: str = "request_id") -> str:
    """`value`, when it may be kept as a label: at most MAX_LABEL_CHARS characters, each
    printable. A label is echoed and written in logs, so it holds no newline or other control
    character (it cannot forge a log line)."""
    if len(value) > MAX_LABEL_CHARS:
        raise InvalidRequestError(f"{param} has {len(value)} characters; at most {MAX_LABEL_CHARS}", param=param)
    if not value.isprintable():
        raise InvalidRequestError(f"{param} must be printable characters only (no control characters)",
                                  param=param)
    return value

"""The error table (`pdserve.common.errors`) spoken over gRPC.

Every servicer method is wrapped by `grpc_errors`: whatever it raises leaves as the status
code of the table, the offending field in trailing metadata `pdserve-error-param` and a
retry delay in `retry-after`. Servicers therefore raise typed errors and never pick codes.
`from_rpc_error` reverses it on the calling side, so a worker's INVALID_ARGUMENT reaches an
HTTP client as a 400.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, NoReturn

import grpc

from pdserve.common.errors import ErrorKind, ServiceError, to_service_error

log = logging.getLogger("pdserve.errors")


def status_code(err: ServiceError) -> grpc.StatusCode:
    return grpc.StatusCode[err.grpc_code]


def from_rpc_error(err: grpc.RpcError) -> ServiceError:
    return to_service_error(err)


async def abort_grpc(context: Any, err: BaseException) -> NoReturn:
    """End a grpc.aio call with `err`'s status (never returns)."""
    service_error = to_service_error(err)
    if service_error.kind is ErrorKind.INTERNAL:
        log.error("internal error: %s", service_error.message, exc_info=err)
    await context.abort(status_code(service_error), service_error.message,
                        trailing_metadata=service_error.grpc_trailing_metadata())
    raise AssertionError("context.abort returned")  # pragma: no cover


def grpc_errors(method):
    """Decorator for grpc.aio servicer methods (unary or server-streaming): exceptions become
    the table's status codes. Cancellation (a BaseException) passes through untouched."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def streaming(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise  # ended by context.abort already
            except Exception as exc:  # noqa: BLE001 - mapped by the table
                await abort_grpc(context, exc)
        return streaming

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise  # ended by context.abort already
        except Exception as exc:  # noqa: BLE001 - mapped by the table
            await abort_grpc(context, exc)
    return unary

"""pdserve's exceptions on the wire: gRPC status + `ErrorCode`, as `pdserve.errors.STATUSES`
(the one table of every boundary) names them.

Servers call `abort_with` / `abort_with_async` (unary RPCs) or `error_reply` (an `Error` message
inside a stream); clients call `error_from_rpc` / `error_from_reply`, which rebuild the same
exception class with its message and retry-after. An error raised on decode therefore reaches
the router as itself. A failure with no pdserve code (the peer is gone, a deadline passed)
becomes InstanceUnavailableError.
"""

from typing import Any, NoReturn, TypeAlias

import grpc

from pdserve.errors import (
    InstanceUnavailableError,
    PdserveError,
    RetryableError,
    class_of_code,
    public_message,
    status_of,
)
from pdserve.v1 import common_pb2

ERROR_CODE_KEY = "pdserve-error-code"
RETRY_AFTER_KEY = "pdserve-retry-after-ms"
_PREFIX = "ERROR_CODE_"

Code: TypeAlias = common_pb2.ErrorCode.ValueType
_CODE_NAMES = {int(code): name.removeprefix(_PREFIX) for name, code in common_pb2.ErrorCode.items()}


def classify(error: BaseException) -> tuple[Code, grpc.StatusCode, str, int]:
    """(error code, gRPC status, message, retry-after ms) of an exception. Anything that is not
    a PdserveError is a bug: INTERNAL, without its details."""
    status = status_of(error)
    retry_after_ms = error.retry_after_ms if isinstance(error, RetryableError) else 0
    return (
        common_pb2.ErrorCode.Value(_PREFIX + status.error_code),
        grpc.StatusCode[status.grpc_status],
        public_message(error),
        retry_after_ms,
    )


def abort_with(context: grpc.ServicerContext, error: BaseException) -> NoReturn:
    """End a unary RPC with `error`'s status; its code and retry-after go in trailing metadata."""
    status, message = _trailers(context, error)
    context.abort(status, message)
    raise AssertionError("context.abort returned")  # it always raises


async def abort_with_async(
    context: "grpc.aio.ServicerContext[Any, Any]", error: BaseException
) -> NoReturn:
    """`abort_with` in an async handler (asyncio servers)."""
    status, message = _trailers(context, error)
    await context.abort(status, message)
    raise AssertionError("context.abort returned")  # it always raises


def _trailers(
    context: "grpc.ServicerContext | grpc.aio.ServicerContext[Any, Any]", error: BaseException
) -> tuple[grpc.StatusCode, str]:
    """Set `error`'s code and retry-after as trailing metadata; returns (status, message)."""
    code, status, message, retry_after_ms = classify(error)
    context.set_trailing_metadata(
        ((ERROR_CODE_KEY, str(int(code))), (RETRY_AFTER_KEY, str(retry_after_ms)))
    )
    return status, message


def error_reply(error: BaseException) -> common_pb2.Error:
    """`error` as the `Error` message of a stream reply."""
    code, _, message, retry_after_ms = classify(error)
    return common_pb2.Error(code=code, message=message, retry_after_ms=retry_after_ms)


def error_from_reply(error: common_pb2.Error) -> PdserveError:
    """The exception an `Error` stream reply stands for."""
    return _build(error.code, error.message, error.retry_after_ms)


def error_from_rpc(error: grpc.RpcError, peer: str) -> PdserveError:
    """The exception a failed call to `peer` stands for: the server's own class when it sent a
    pdserve code, else InstanceUnavailableError (unreachable, deadline, cancelled, crashed)."""
    metadata = dict(_trailing(error))
    details = error.details() if hasattr(error, "details") else str(error)
    if ERROR_CODE_KEY in metadata:
        retry_after_ms = int(metadata.get(RETRY_AFTER_KEY, "0") or 0)
        return _build(int(metadata[ERROR_CODE_KEY]), details or "", retry_after_ms)
    status = error.code().name if hasattr(error, "code") else "UNKNOWN"
    return InstanceUnavailableError(f"instance {peer} failed: {status}: {details}")


def _build(code: int, message: str, retry_after_ms: int) -> PdserveError:
    """The exception an error code stands for (PdserveError for one this version lacks)."""
    cls = class_of_code(_CODE_NAMES.get(code, ""))
    if issubclass(cls, RetryableError):
        return cls(message, retry_after_ms)
    return cls(message)


def _trailing(error: grpc.RpcError) -> list[tuple[str, str]]:
    getter = getattr(error, "trailing_metadata", None)
    metadata = getter() if getter is not None else None
    return [(k, v if isinstance(v, str) else v.decode()) for k, v in (metadata or ())]

"""Every error class pdserve raises on purpose, in one small hierarchy, and the one table of how
each crosses a boundary (`STATUSES`).

Library code raises these; servicers and the HTTP API map them through `STATUSES`: to a gRPC
status and pdserve `ErrorCode` (`pdserve.rpc.status`, used by servers and clients alike, so an
error keeps its class across every hop) and to an HTTP status with an OpenAI-style error
(`http_error`). Every message says what was wrong and what to do about it.

    PdserveError
      ConfigError, ModelLoadError, IntegrityError, BlockStoreError, ClusterError,
      NoCandidateError
      InvalidRequestError            the caller's mistake: never retried
        PromptTooLongError, DuplicateRequestError, ModelNotFoundError
      RequestNotFoundError
      RequestAbortedError
      RetryableError(retry_after_ms)  try again later, or elsewhere
        ResourceExhaustedError       no capacity now (a decode refusal, an exhausted pool)
          OutOfBlocksError
        NoCapacityError              the router ran out of instances or attempts
        KVTransferError              a KV transfer or handoff failed
        InstanceUnavailableError     a peer cannot be reached or did not answer in time
          DecodeUnavailableError     ... and that peer is the request's decode instance
            StreamMovedError         the router moved a stream off a drained decode instance
        StepFailedError              the engine step running the request failed
          TensorParallelError
"""

from collections.abc import Callable
from dataclasses import dataclass


class PdserveError(Exception):
    """Base of every error pdserve raises on purpose."""


class ConfigError(PdserveError):
    """A configuration value is missing, malformed or out of range."""


class ModelLoadError(PdserveError):
    """A model directory cannot be loaded (missing files, unsupported architecture, bad weights)."""


class IntegrityError(PdserveError):
    """`check_integrity()` found a component's bookkeeping inconsistent (a bug, not bad input)."""


class BlockStoreError(PdserveError):
    """A block store could not read or write a block (missing, unreadable, unreachable)."""


class ClusterError(PdserveError):
    """The cluster cannot be started, found or changed as asked."""


class InvalidRequestError(PdserveError):
    """A request is malformed or its parameters are out of range (the caller's mistake)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit the model's context window or an instance's KV cache."""


class DuplicateRequestError(InvalidRequestError):
    """A live request already has the given id."""


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this router does not serve."""


class NoCandidateError(PdserveError):
    """A routing policy was given no instance to choose from."""


class RequestNotFoundError(PdserveError):
    """No live request has the given id."""


class RequestAbortedError(PdserveError):
    """The request was aborted (by its client, an operator or a peer) before it finished."""


class AuthenticationError(PdserveError):
    """The request carries no valid API key (`router.api_keys`)."""


class RetryableError(PdserveError):
    """A condition that may clear: retry after `retry_after_ms` (0: at once), possibly on
    another instance."""

    def __init__(self, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class ResourceExhaustedError(RetryableError):
    """No capacity now (a decode instance refused a reservation, a pool is full)."""


class OutOfBlocksError(ResourceExhaustedError):
    """The KV block pool cannot satisfy an allocation; callers check `can_allocate` first."""


class NoCapacityError(RetryableError):
    """Every attempt failed or no instance is available; retry later."""


class RateLimitedError(RetryableError):
    """Too many requests: the API key's rate, or the router's admission queue (full, or the
    request waited its limit in it); retry after `retry_after_ms`."""


class KVTransferError(RetryableError):
    """A transfer failed (peer gone, reservation unknown or expired, size mismatch)."""


class InstanceUnavailableError(RetryableError):
    """A peer instance cannot be reached, or did not answer before its deadline."""


class DecodeUnavailableError(InstanceUnavailableError):
    """The decode instance of a request cannot be reached: raised by a prefill instance for its
    calls to decode, and by the router's client when an instance's output subscription is lost.
    The router blames decode, not the prefill instance that reported it."""


class StreamMovedError(DecodeUnavailableError):
    """The router moved a stream off its decode instance `address` on purpose (the instance is
    drained): the request continues on another, reading the first `num_blocks` blocks of its
    context back from this one. Nobody is to blame. Router-internal: it never crosses the
    wire."""

    def __init__(self, message: str, address: str, num_blocks: int) -> None:
        super().__init__(message)
        self.address = address
        self.num_blocks = num_blocks
        # ends the router's hold on `address` (it keeps the drained instance from being stopped
        # before the request's next attempt reads from it)
        self.release_hold: Callable[[], object] | None = None


class StepFailedError(RetryableError):
    """The engine step that ran this request raised; the request was failed, the engine serves
    the others."""


class TensorParallelError(StepFailedError):
    """A collective of a tensor-parallel instance failed or timed out (a rank died or hangs):
    the instance's requests fail with it until the instance is restarted."""


@dataclass(frozen=True, slots=True)
class Status:
    """How errors of one class cross each boundary. The gRPC status and pdserve's `ErrorCode`
    go by name (this module, the lowest layer, imports neither grpc nor the generated protos:
    `pdserve.rpc.status` converts); HTTP's is the OpenAI-style error the router answers."""

    grpc_status: str  # a grpc.StatusCode member
    error_code: str  # a pdserve.v1.ErrorCode value, without its ERROR_CODE_ prefix
    http_status: int
    http_type: str  # OpenAI's error `type`
    http_code: str | None  # OpenAI's error `code`
    http_prefix: str = ""  # before the message: an instance's failure, not the caller's


_INVALID = "invalid_request_error"
_OVERLOADED = "server_overloaded"
_FAILED = "the request failed: "

# Most specific class first: an error's row is the first whose class it is an instance of.
# The last row of each ErrorCode is its most general reading: the class it is rebuilt as.
STATUSES: tuple[tuple[type[PdserveError], Status], ...] = (
    (PromptTooLongError, Status("INVALID_ARGUMENT", "PROMPT_TOO_LONG", 400, _INVALID,
                                "context_length_exceeded")),
    (DuplicateRequestError, Status("ALREADY_EXISTS", "DUPLICATE_REQUEST", 400, _INVALID, None)),
    (ModelNotFoundError, Status("NOT_FOUND", "MODEL_NOT_FOUND", 404, _INVALID, "model_not_found")),
    (InvalidRequestError, Status("INVALID_ARGUMENT", "INVALID_REQUEST", 400, _INVALID, None)),
    (AuthenticationError, Status("UNAUTHENTICATED", "UNAUTHENTICATED", 401, _INVALID,
                                 "invalid_api_key")),
    (RateLimitedError, Status("RESOURCE_EXHAUSTED", "RATE_LIMITED", 429, "requests",
                              "rate_limit_exceeded")),
    (RequestNotFoundError, Status("NOT_FOUND", "NOT_FOUND", 503, "server_error", "upstream_error",
                                  _FAILED)),
    (RequestAbortedError, Status("CANCELLED", "REQUEST_ABORTED", 503, "server_error",
                                 "request_aborted")),
    (OutOfBlocksError, Status("RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED", 503, _OVERLOADED,
                              "no_capacity")),
    (NoCapacityError, Status("RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED", 503, _OVERLOADED,
                             "no_capacity")),
    (ResourceExhaustedError, Status("RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED", 503, _OVERLOADED,
                                    "no_capacity")),
    (KVTransferError, Status("FAILED_PRECONDITION", "TRANSFER_FAILED", 503, "server_error",
                             "upstream_error", _FAILED)),
    (DecodeUnavailableError, Status("UNAVAILABLE", "DECODE_UNAVAILABLE", 503, "server_error",
                                    "upstream_error", _FAILED)),
    (InstanceUnavailableError, Status("UNAVAILABLE", "UNAVAILABLE", 503, "server_error",
                                      "upstream_error", _FAILED)),
    (StepFailedError, Status("ABORTED", "STEP_FAILED", 503, "server_error", "upstream_error",
                             _FAILED)),
    (PdserveError, Status("INTERNAL", "INTERNAL", 503, "server_error", "upstream_error", _FAILED)),
)  # fmt: skip
INTERNAL = Status("INTERNAL", "INTERNAL", 500, "server_error", None)
"""Any other exception: a bug. Its details stay on the server (`public_message`)."""


def status_of(error: BaseException) -> Status:
    """The row of `error`'s class; INTERNAL for an exception that is not a PdserveError."""
    if isinstance(error, PdserveError):
        return next(status for cls, status in STATUSES if isinstance(error, cls))
    return INTERNAL


def public_message(error: BaseException) -> str:
    """What a caller is told of `error`: its message, none of a bug's details."""
    return str(error) if isinstance(error, PdserveError) else "internal error"


def class_of_code(error_code: str) -> type[PdserveError]:
    """The class an `ErrorCode` (by name, without its prefix) is rebuilt as: its last row's
    (PdserveError for a code no row has)."""
    rows = [cls for cls, status in STATUSES if status.error_code == error_code]
    return rows[-1] if rows else PdserveError


@dataclass(frozen=True, slots=True)
class HttpError:
    """An error as the HTTP API answers it (OpenAI's error object and a Retry-After header)."""

    status: int
    type: str
    code: str | None
    message: str
    retry_after_s: int | None  # a 429's or 503's: when the client may try again


def http_error(error: BaseException) -> HttpError:
    """`error` as the HTTP API reports it (`STATUSES`)."""
    status = status_of(error)
    message = status.http_prefix + str(error) if status is not INTERNAL else "internal server error"
    retry_after_s = None
    if status.http_status in (429, 503):
        retry_after_ms = error.retry_after_ms if isinstance(error, RetryableError) else 0
        retry_after_s = max(1, round((retry_after_ms or 1000) / 1000))
    return HttpError(status.http_status, status.http_type, status.http_code, message, retry_after_s)

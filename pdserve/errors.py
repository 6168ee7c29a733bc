"""Every error class pdserve raises on purpose, in one small hierarchy.

Library code raises these; servicers and the HTTP API map them to gRPC statuses and OpenAI-style
errors (`pdserve.rpc.status` holds the one exception <-> status table, used by servers and
clients alike, so an error keeps its class across every hop). Every message says what was wrong
and what to do about it.

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
        StepFailedError              the engine step running the request failed
"""


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


class KVTransferError(RetryableError):
    """A transfer failed (peer gone, reservation unknown or expired, size mismatch)."""


class InstanceUnavailableError(RetryableError):
    """A peer instance cannot be reached, or did not answer before its deadline."""


class DecodeUnavailableError(InstanceUnavailableError):
    """The decode instance of a request cannot be reached: raised by a prefill instance for its
    calls to decode, and by the router's client for the token stream. The router blames decode,
    not the prefill instance that reported it."""


class StepFailedError(RetryableError):
    """The engine step that ran this request raised; the request was failed, the engine serves
    the others."""


class TensorParallelError(StepFailedError):
    """A collective of a tensor-parallel instance failed or timed out (a rank died or hangs):
    the instance's requests fail with it until the instance is restarted."""

"""Typed exception hierarchy.

Servicers and the HTTP API map these to gRPC status codes and OpenAI-style errors; library code
raises them and never formats transport-level errors itself. Every message says what was wrong and
what to do about it.
"""


class PdserveError(Exception):
    """Base of every error pdserve raises on purpose."""


class ConfigError(PdserveError):
    """A configuration value is missing, malformed or out of range."""


class ModelLoadError(PdserveError):
    """A model directory cannot be loaded (missing files, unsupported architecture, bad weights)."""


class InvalidRequestError(PdserveError):
    """A request is malformed or its parameters are out of range (the caller's mistake)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit the model's context window or the KV cache."""


class RequestNotFoundError(PdserveError):
    """No live request has the given id."""


class DuplicateRequestError(InvalidRequestError):
    """A live request already has the given id."""


class OutOfBlocksError(PdserveError):
    """The KV block pool cannot satisfy an allocation; callers check `can_allocate` first."""


class IntegrityError(PdserveError):
    """`check_integrity()` found a component's bookkeeping inconsistent (a bug, not bad input)."""

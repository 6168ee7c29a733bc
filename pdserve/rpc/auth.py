"""Bearer-token authentication for every pdserve gRPC server (instances and admin).

Servers install `BearerTokenInterceptor(secret)` (`AioBearerTokenInterceptor` on asyncio
servers): a call whose `authorization` metadata is not `Bearer <secret>` (compared in constant
time) ends with UNAUTHENTICATED before its handler runs, so it changes nothing. Only health
answers without it (load balancers, probes). Clients add the header to every call of a channel
(`authenticated_channel`; `ChannelPool` does it for every peer when given the secret). Secrets
are generated with `secrets`, kept in 0600 files (`secret_file`) and never logged or echoed in
an error.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc

from pdserve.errors import ConfigError

# Only health answers without credentials (load balancers, probes). Reflection is guarded too:
# its streams are long-lived, and anonymous ones could hold every worker thread of a server.
UNGUARDED = ("/grpc.health.v1.Health/",)
AUTHORIZATION = "authorization"
DENIED = "missing or wrong credentials: pass the cluster secret (see docs/security.md)"

if TYPE_CHECKING:
    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]


def new_secret() -> str:
    """A fresh secret: 256 random bits, URL-safe text."""
    return secrets.token_urlsafe(32)


def secret_file(path: Path, configured: str | None = None) -> str:
    """`configured` when set; else the secret kept in `path`, created on first use. The file
    is this user's, mode 0600, in a directory that is this user's and that nobody else may write
    (created 0700); anything else is refused with ConfigError rather than trusted. Never logs
    the secret."""
    if configured:
        return configured
    _check_private_dir(path.parent)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return _create_secret(path)
    except OSError as e:  # a symlink, among others
        raise ConfigError(f"cannot use secret file {path}: {e.strerror}") from e
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ConfigError(
                f"secret file {path} must belong to you with mode 0600; remove it to get a new one"
            )
        existing = f.read().strip()
    return existing or _create_secret(path)


def _check_private_dir(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = directory.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ConfigError(
            f"{directory} holds secrets but is not yours alone (owner or group/world write): "
            "use a state dir of your own (cluster.state_dir)"
        )


def _create_secret(path: Path) -> str:
    """A new secret in `path`, written to a fresh 0600 file (O_EXCL, no symlink followed) that
    then replaces it: no moment in which it exists with other permissions."""
    secret = new_secret()
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.replace(tmp, path)
    return secret


class _TokenCheck:
    """The check both interceptors make: stateless after construction, safe on any thread."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("an empty token would authenticate nobody")
        self._expected = f"Bearer {token}".encode()

    def admits(self, details: grpc.HandlerCallDetails) -> bool:
        """Whether the call may reach its handler: an unguarded method, or the right token."""
        if details.method.startswith(UNGUARDED):
            return True
        sent = dict(details.invocation_metadata or ()).get(AUTHORIZATION, "")
        sent_bytes = sent.encode() if isinstance(sent, str) else sent
        return hmac.compare_digest(sent_bytes, self._expected)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls whose `authorization` metadata is not `Bearer <token>` (thread servers)."""

    def __init__(self, token: str) -> None:
        self._check = _TokenCheck(token)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(details)
        if handler is None or self._check.admits(details):
            return handler
        return _denial(handler, _deny)


class AioBearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """`BearerTokenInterceptor` for `grpc.aio` servers (instances)."""

    def __init__(self, token: str) -> None:
        self._check = _TokenCheck(token)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(details)
        if handler is None or self._check.admits(details):
            return handler
        return _denial(handler, _deny_async)


def _deny(request: object, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)


async def _deny_async(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)


def _denial(handler: Handler, deny: Callable[..., Any]) -> Handler:
    """A handler of the same kind as `handler` that only answers UNAUTHENTICATED (it reads no
    request: nothing of the call reaches the service)."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class _AddToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call."""

    def __init__(self, token: str) -> None:
        self._header = (AUTHORIZATION, f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self._header]
        return _CallDetails(
            details.method, details.timeout, metadata, details.credentials,
            getattr(details, "wait_for_ready", None), getattr(details, "compression", None),
        )  # fmt: skip

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(
        self,
        method: str,
        timeout: float | None,
        metadata: Any,
        credentials: Any,
        wait_for_ready: bool | None,
        compression: Any,
    ) -> None:
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


def authenticated_channel(channel: grpc.Channel, token: str) -> grpc.Channel:
    """`channel`, sending `Bearer <token>` with every call."""
    return grpc.intercept_channel(channel, _AddToken(token))

"""Bearer-token authentication for every pdserve gRPC server (instances and admin).

Servers install `BearerTokenInterceptor(secret)`: a call whose `authorization` metadata is not
`Bearer <secret>` (compared in constant time) ends with UNAUTHENTICATED before its handler runs,
so it changes nothing. Health and reflection answer without it (load balancers, `grpcurl list`).
Clients add the header to every call of a channel (`authenticated_channel`; `ChannelPool` does it
for every peer when given the secret). Secrets are generated with `secrets`, kept in 0600 files
(`secret_file`) and never logged or echoed in an error.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc

UNGUARDED = ("/grpc.health.v1.Health/", "/grpc.reflection.")
AUTHORIZATION = "authorization"
DENIED = "missing or wrong credentials: pass the cluster secret (see docs/security.md)"

if TYPE_CHECKING:
    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]


def new_secret() -> str:
    """A fresh secret: 256 random bits, URL-safe text."""
    return secrets.token_urlsafe(32)


def secret_file(path: Path, configured: str | None = None) -> str:
    """`configured` when set; else the secret kept in `path`, created (mode 0600, directory
    0700) on first use. Never logs it."""
    if configured:
        return configured
    try:
        existing = path.read_text().strip()
    except FileNotFoundError:
        existing = ""
    if existing:
        return existing
    secret = new_secret()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls whose `authorization` metadata is not `Bearer <token>`.

    Stateless after construction: safe on every handler thread.
    """

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("an empty token would authenticate nobody")
        self._expected = f"Bearer {token}".encode()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(details)
        if details.method.startswith(UNGUARDED) or handler is None:
            return handler
        sent = dict(details.invocation_metadata or ()).get(AUTHORIZATION, "")
        sent_bytes = sent.encode() if isinstance(sent, str) else sent
        if hmac.compare_digest(sent_bytes, self._expected):
            return handler
        return _denial(handler)


def _denial(handler: Handler) -> Handler:
    """A handler of the same kind as `handler` that only answers UNAUTHENTICATED (it reads no
    request: nothing of the call reaches the service)."""

    def deny(request: object, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

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

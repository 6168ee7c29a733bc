"""Asyncio clients for the router's request path (`grpc.aio`): a request's Prefill call and its
token stream are awaited on the event loop, so an open stream holds no thread and a token costs
no thread hop. Same deadlines, credentials and typed errors as the blocking clients of
`pdserve.rpc.clients`.

Channels belong to the event loop that created them: an `AioChannelPool` is used from one
loop (the router's HTTP server's).
"""

from collections.abc import AsyncIterator
from typing import Any

import grpc

from pdserve.rpc.auth import AUTHORIZATION
from pdserve.rpc.channels import CHANNEL_OPTIONS
from pdserve.rpc.clients import DEFAULT_DEADLINES, Deadlines
from pdserve.rpc.status import error_from_reply, error_from_rpc
from pdserve.rpc.tls import TlsFiles
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    mixed_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)


class AioChannelPool:
    """One `grpc.aio` channel per peer, created on first use (inside the loop)."""

    def __init__(self, secret: str | None = None, tls: TlsFiles | None = None) -> None:
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.metadata: tuple[tuple[str, str], ...] = (
            ((AUTHORIZATION, f"Bearer {secret}"),) if secret else ()
        )

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            if self._tls is not None:
                credentials, options = self._tls.channel_credentials(CHANNEL_OPTIONS)
                channel = grpc.aio.secure_channel(address, credentials, options=options)
            else:
                channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


class AioClients:
    """The calls of a request's path, to any instance."""

    def __init__(self, channels: AioChannelPool, deadlines: Deadlines = DEFAULT_DEADLINES) -> None:
        self.channels = channels
        self.deadlines = deadlines

    async def prefill(
        self, address: str, message: prefill_pb2.PrefillRequest
    ) -> prefill_pb2.PrefillResult:
        stub = prefill_pb2_grpc.PrefillServiceStub(self.channels.get(address))
        try:
            result: prefill_pb2.PrefillResult = await stub.Prefill(
                message, timeout=self.deadlines.prefill_s, metadata=self.channels.metadata
            )
        except grpc.RpcError as e:
            raise error_from_rpc(e, address) from e
        return result

    def stream_tokens(
        self, address: str, request_id: str, attempt: str = ""
    ) -> AsyncIterator[common_pb2.TokenChunk | common_pb2.TokenFinal]:
        """Decode's token stream of a request (with `attempt`: opened before its reservation,
        which it waits for)."""
        stub = decode_pb2_grpc.DecodeServiceStub(self.channels.get(address))
        call = stub.StreamTokens(
            decode_pb2.StreamTokensRequest(request_id=request_id, attempt=attempt),
            timeout=self.deadlines.stream_s,
            metadata=self.channels.metadata,
        )
        return token_replies(call, address)

    def generate_mixed(
        self, address: str, message: common_pb2.GenerateRequest
    ) -> AsyncIterator[common_pb2.TokenChunk | common_pb2.TokenFinal]:
        stub = mixed_pb2_grpc.MixedServiceStub(self.channels.get(address))
        call = stub.Generate(
            message, timeout=self.deadlines.stream_s, metadata=self.channels.metadata
        )
        return token_replies(call, address)


async def token_replies(
    call: Any, peer: str
) -> AsyncIterator[common_pb2.TokenChunk | common_pb2.TokenFinal]:
    """A token stream's chunks and final reply; an error reply or a broken stream raises the
    typed exception. Leaving the loop (or closing the iterator) cancels the call."""
    try:
        async for reply in call:
            item = reply_item(reply)
            yield item
            if isinstance(item, common_pb2.TokenFinal):
                return
    except grpc.RpcError as e:
        raise error_from_rpc(e, peer) from e
    finally:
        call.cancel()


def reply_item(reply: common_pb2.TokenReply) -> common_pb2.TokenChunk | common_pb2.TokenFinal:
    """A token stream reply's chunk or final reply; raises the typed error of an error reply."""
    kind = reply.WhichOneof("reply")
    if kind == "chunk":
        return reply.chunk
    if kind == "final":
        return reply.final
    raise error_from_reply(reply.error)

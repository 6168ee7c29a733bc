"""Asyncio clients for the router's request path (`grpc.aio`): a request's Prefill or Submit call
and the instance's output subscription are awaited on the event loop, so an open stream holds
no thread and a step's outputs cost no thread hop. Same deadlines, credentials and typed errors
as the blocking clients of `pdserve.rpc.clients`.

Channels belong to the event loop that created them: an `AioChannelPool` is used from one
loop (the router's HTTP server's), but for `forget`.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from pdserve.rpc.auth import AUTHORIZATION
from pdserve.rpc.channels import CHANNEL_OPTIONS, CLOSE_FORGOTTEN_AFTER_S
from pdserve.rpc.clients import DEFAULT_DEADLINES, Deadlines, Metadata
from pdserve.rpc.status import error_from_rpc
from pdserve.rpc.tls import TlsFiles
from pdserve.v1 import (
    common_pb2,
    common_pb2_grpc,
    decode_pb2_grpc,
    mixed_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)


@dataclass(frozen=True, slots=True)
class Stubs:
    """The services of one peer, on its channel (built once: a stub builds a callable per
    method)."""

    # the async stub types exist only in the generated .pyi files
    prefill: "prefill_pb2_grpc.PrefillServiceAsyncStub"
    mixed: "mixed_pb2_grpc.MixedServiceAsyncStub"
    instance: "common_pb2_grpc.InstanceServiceAsyncStub"
    decode: "decode_pb2_grpc.DecodeServiceAsyncStub"


class AioChannelPool:
    """One `grpc.aio` channel per peer, and its stubs, created on first use (inside the
    loop)."""

    def __init__(self, secret: str | None = None, tls: TlsFiles | None = None) -> None:
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, Stubs] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the one its channels belong to
        self._closing: set[asyncio.Task[None]] = set()
        self.metadata: tuple[tuple[str, str], ...] = (
            ((AUTHORIZATION, f"Bearer {secret}"),) if secret else ()
        )

    def stubs(self, address: str) -> Stubs:
        stubs = self._stubs.get(address)
        if stubs is None:
            channel = self.get(address)
            stubs = Stubs(
                prefill_pb2_grpc.PrefillServiceStub(channel),
                mixed_pb2_grpc.MixedServiceStub(channel),
                common_pb2_grpc.InstanceServiceStub(channel),
                decode_pb2_grpc.DecodeServiceStub(channel),
            )
            self._stubs[address] = stubs
        return stubs

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            self._loop = asyncio.get_running_loop()
            if self._tls is not None:
                credentials, options = self._tls.channel_credentials(CHANNEL_OPTIONS)
                channel = grpc.aio.secure_channel(address, credentials, options=options)
            else:
                channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = channel
        return channel

    def forget(self, address: str, keep: Callable[[], bool] = lambda: False) -> None:
        """From any thread: on the loop, soon, unless `keep()` then says its peer is back, drop
        `address`'s channel and stubs (a later `get` dials it anew) and close the channel,
        letting calls still on it finish for `CLOSE_FORGOTTEN_AFTER_S`. For a peer that is
        gone (see `ChannelPool.forget`)."""
        if self._loop is None:  # no channel yet
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: its channels with it
            self._loop.call_soon_threadsafe(self._forget, address, keep)

    def _forget(self, address: str, keep: Callable[[], bool]) -> None:
        if keep():
            return
        self._stubs.pop(address, None)
        channel = self._channels.pop(address, None)
        if channel is not None:
            task = asyncio.ensure_future(channel.close(grace=CLOSE_FORGOTTEN_AFTER_S))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        self._stubs = {}
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
        await asyncio.gather(*self._closing)


class AioClients:
    """The calls of a request's path, to any instance."""

    def __init__(self, channels: AioChannelPool, deadlines: Deadlines = DEFAULT_DEADLINES) -> None:
        self.channels = channels
        self.deadlines = deadlines

    async def prefill(
        self, address: str, message: prefill_pb2.PrefillRequest, metadata: Metadata = ()
    ) -> prefill_pb2.PrefillResult:
        """`metadata`: the request's own (its trace context), sent with the credentials."""
        try:
            result: prefill_pb2.PrefillResult = await self.channels.stubs(address).prefill.Prefill(
                message,
                timeout=self.deadlines.prefill_s,
                metadata=self.channels.metadata + metadata,
            )
        except grpc.RpcError as e:
            raise error_from_rpc(e, address) from e
        return result

    async def submit(
        self,
        address: str,
        message: common_pb2.GenerateRequest,
        metadata: Metadata = (),
        on_decode: bool = False,
    ) -> None:
        """Queue a whole generation on a mixed instance, or (`on_decode`) on a decode instance
        that computes the prompt itself; its outputs go to its subscription."""
        stubs = self.channels.stubs(address)
        call = stubs.decode.Generate if on_decode else stubs.mixed.Submit
        try:
            await call(
                message,
                timeout=self.deadlines.control_s,
                metadata=self.channels.metadata + metadata,
            )
        except grpc.RpcError as e:
            raise error_from_rpc(e, address) from e

    async def abort(self, address: str, request_id: str, attempt: str = "") -> bool:
        """Abort a request on an instance (only that attempt of it, when given); whether it
        held it."""
        try:
            reply = await self.channels.stubs(address).instance.Abort(
                common_pb2.AbortRequest(request_id=request_id, attempt=attempt),
                timeout=self.deadlines.control_s,
                metadata=self.channels.metadata,
            )
        except grpc.RpcError as e:
            raise error_from_rpc(e, address) from e
        return bool(reply.found)

    async def subscribe_outputs(
        self, address: str, subscriber: str
    ) -> AsyncIterator[common_pb2.StepOutputs]:
        """The instance's output subscription for `subscriber`: an empty message once it is
        open, then one per step. A broken stream raises the typed exception; leaving the loop
        (or closing the iterator) cancels the call."""
        call = self.channels.stubs(
            address
        ).instance.SubscribeOutputs(  # no deadline: it lives as long as the router
            common_pb2.OutputsRequest(subscriber=subscriber), metadata=self.channels.metadata
        )
        try:
            async for message in call:
                yield message
        except grpc.RpcError as e:
            raise error_from_rpc(e, address) from e
        finally:
            call.cancel()

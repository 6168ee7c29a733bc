"""OutputSubscriptions: the router's end of the instances' output subscriptions.

A decode or mixed instance sends the outputs of every request this router gave it on one stream
(`InstanceService.SubscribeOutputs`), one message per engine step. The router opens that stream
once per instance, when a request first needs it, and keeps it; each request attempt registers
a `RequestReplies` queue under (request id, attempt) and reads its outputs from it. When the
stream breaks, every request registered on it gets the error — DecodeUnavailableError: the
side that streams the outputs is the one lost (for a mixed instance, the instance) — its attempt
fails over as any broken stream does, and the next request opens a new subscription.

Runs on the router's event loop only: no locks.
"""

import asyncio
import collections
import logging
import uuid
from collections.abc import Callable

from pdserve.errors import DecodeUnavailableError, InstanceUnavailableError, PdserveError
from pdserve.rpc.aio import AioClients
from pdserve.rpc.status import error_from_reply
from pdserve.v1 import common_pb2

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (request id, attempt)


class RequestReplies:
    """One attempt's outputs, in order; an error ends them."""

    def __init__(self) -> None:
        self._items: collections.deque[common_pb2.RequestOutputs | PdserveError] = (
            collections.deque()
        )
        self._waiter: asyncio.Future[None] | None = None

    def push(self, item: common_pb2.RequestOutputs | PdserveError) -> None:
        self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> list[common_pb2.RequestOutputs]:
        """Every output that came since the last call (at least one: a reader that falls
        behind takes its backlog at once); raises the request's error (an error reply, or the
        subscription's end) once the outputs before it were taken."""
        items = self._items
        while not items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        taken: list[common_pb2.RequestOutputs] = []
        while items:
            item = items[0]
            failed = isinstance(item, PdserveError) or item.HasField("error")
            if failed and taken:
                break  # raised by the next call
            items.popleft()
            if isinstance(item, PdserveError):
                raise item
            if failed:
                raise error_from_reply(item.error)
            taken.append(item)
        return taken


class _Subscription:
    """One instance's output stream and the attempts reading from it."""

    def __init__(
        self,
        address: str,
        aio: AioClients,
        subscriber: str,
        on_end: Callable[["_Subscription"], None],
    ) -> None:
        self.address = address
        self.requests: dict[Key, RequestReplies] = {}
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._on_end = on_end
        self.task = asyncio.ensure_future(self._run(aio, subscriber))

    async def _run(self, aio: AioClients, subscriber: str) -> None:
        error: PdserveError = DecodeUnavailableError(
            f"instance {self.address} ended its output subscription"
        )
        try:
            async for message in aio.subscribe_outputs(self.address, subscriber):
                if not self.opened.done():
                    self.opened.set_result(None)  # the first message is empty: it is open
                for output in message.outputs:
                    replies = self.requests.get((output.request_id, output.attempt))
                    if replies is not None:
                        replies.push(output)
        except InstanceUnavailableError as e:
            lost = isinstance(e, DecodeUnavailableError)
            error = e if lost else DecodeUnavailableError(str(e), e.retry_after_ms)
        except PdserveError as e:
            error = e
        except asyncio.CancelledError:
            error = DecodeUnavailableError(f"the router left {self.address}'s subscription")
            raise
        finally:
            self._on_end(self)
            if not self.opened.done():
                self.opened.set_exception(error)
                self.opened.exception()  # retrieved: only registered attempts care
            for replies in self.requests.values():
                replies.push(error)
            if self.requests:
                logger.warning(
                    "output subscription to %s ended with %d requests on it: %s",
                    self.address, len(self.requests), error,
                )  # fmt: skip


class OutputSubscriptions:
    """This router's subscriptions, one per instance, under one subscriber id."""

    def __init__(self, aio: AioClients) -> None:
        self.subscriber = uuid.uuid4().hex
        self._aio = aio
        self._subscriptions: dict[str, _Subscription] = {}

    async def register(self, address: str, request_id: str, attempt: str) -> RequestReplies:
        """The queue of the attempt's outputs from `address`, once its subscription is open
        there (opened now if needed). Raises the error that kept it from opening."""
        subscription = self._subscriptions.get(address)
        if subscription is None:
            subscription = _Subscription(address, self._aio, self.subscriber, self._ended)
            self._subscriptions[address] = subscription
        replies = subscription.requests[(request_id, attempt)] = RequestReplies()
        await asyncio.shield(subscription.opened)
        return replies

    def unregister(self, address: str, request_id: str, attempt: str) -> None:
        subscription = self._subscriptions.get(address)
        if subscription is not None:
            subscription.requests.pop((request_id, attempt), None)

    async def close(self) -> None:
        """End every subscription (on the router's loop, before it stops)."""
        subscriptions, self._subscriptions = list(self._subscriptions.values()), {}
        for subscription in subscriptions:
            subscription.task.cancel()
        await asyncio.gather(*(s.task for s in subscriptions), return_exceptions=True)

    def _ended(self, subscription: _Subscription) -> None:
        if self._subscriptions.get(subscription.address) is subscription:
            del self._subscriptions[subscription.address]

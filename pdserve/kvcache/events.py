"""KV events: what a cache published or dropped, for the router's prefix index."""

import contextlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.kvcache.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks whose KV is fully computed and now matchable, in chain order."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks that are no longer matchable on this instance."""

    block_hashes: tuple[BlockHash, ...]


KVEvent = BlockStored | BlockRemoved
KVEventSink = Callable[[KVEvent], None]
"""Called synchronously by the cache manager; must not block (enqueue and return)."""


class KVEventBroadcaster:
    """Fans KV events out to subscribers (e.g. router streams). `publish` never blocks: a
    subscriber that falls `max_backlog` events behind is dropped (it receives None and must
    resubscribe and rebuild its view).

    Thread-safe: the engine thread publishes, gRPC handler threads subscribe and read.
    """

    def __init__(self, max_backlog: int = 10_000) -> None:
        self._subscribers: list[queue.Queue[KVEvent | None]] = []
        self._lock = threading.Lock()
        self._max_backlog = max_backlog

    def subscribe(self) -> "queue.Queue[KVEvent | None]":
        subscriber: queue.Queue[KVEvent | None] = queue.Queue(self._max_backlog)
        with self._lock:
            self._subscribers.append(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: "queue.Queue[KVEvent | None]") -> None:
        with self._lock:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)

    def disconnect_all(self) -> None:
        """End every subscription: each subscriber receives None (and may resubscribe)."""
        with self._lock:
            subscribers, self._subscribers = self._subscribers, []
        for subscriber in subscribers:
            _end(subscriber)

    def publish(self, event: KVEvent) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for subscriber in subscribers:
            try:
                subscriber.put_nowait(event)
            except queue.Full:
                self.unsubscribe(subscriber)
                _end(subscriber)


def _end(subscriber: "queue.Queue[KVEvent | None]") -> None:
    """Put the None that ends a subscription, dropping older events to make room (it ends, so
    they no longer matter; the engine thread may still be publishing into it)."""
    while True:
        try:
            subscriber.put_nowait(None)
            return
        except queue.Full:
            with contextlib.suppress(queue.Empty):
                subscriber.get_nowait()

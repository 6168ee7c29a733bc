"""KV events: what a cache published or dropped, for the routers' prefix indexes, and the
stream that carries them to the routers with the instance's load.

Every event an instance publishes gets the next number of the instance's *epoch* (a random id
drawn when it starts): a router that applied events 1..n of an epoch knows it holds exactly the
instance's published set after event n, sees a gap, a repeat or a restart at once, and resumes
from n (`KVEventBroadcaster.subscribe` replays from a bounded buffer, else the subscriber starts
over from a snapshot). A periodic `KVDigest` (the set's size and a sum of its hashes) lets a
router check that its copy did not drift silently.
"""

import contextlib
import queue
import secrets
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

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

DIGEST_MODULUS = 1 << 64


def digest_term(block_hash: BlockHash) -> int:
    """A block's share of a digest's `hash_sum`: its hash's first 8 bytes (little-endian)."""
    return int.from_bytes(block_hash[:8], "little")


@dataclass(frozen=True, slots=True)
class KVDigest:
    """A published block set in brief: how many blocks, and the sum of their `digest_term`s
    modulo 2**64 (order-free, so both sides keep it as blocks come and go)."""

    num_blocks: int = 0
    hash_sum: int = 0

    @classmethod
    def of(cls, block_hashes: Iterable[BlockHash]) -> "KVDigest":
        hashes = list(block_hashes)
        return cls(len(hashes), sum(map(digest_term, hashes)) % DIGEST_MODULUS)

    def changed(self, stored: Iterable[BlockHash], removed: Iterable[BlockHash]) -> "KVDigest":
        """The digest after `stored` (absent before) and `removed` (present before)."""
        stored, removed = list(stored), list(removed)
        total = self.hash_sum + sum(map(digest_term, stored)) - sum(map(digest_term, removed))
        return KVDigest(self.num_blocks + len(stored) - len(removed), total % DIGEST_MODULUS)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """An instance's load as its engine thread saw it after a step: what the routers' policies
    weigh. `received`: per router (its output subscriber id), the highest route number of the
    requests it sent here that this report counts (`GenerateRequest.route_seq`)."""

    num_running: int = 0
    num_waiting: int = 0
    num_reservations: int = 0  # decode: prompts whose KV is on its way
    queued_prefill_tokens: int = 0  # prompt tokens admitted and not computed yet
    num_free_blocks: int = 0
    num_reserved_blocks: int = 0
    num_blocks: int = 0
    predicted_queue_s: float = 0.0  # the step time model's time for the queued prompt tokens
    received: dict[str, int] = field(default_factory=dict)
    leaving: bool = False  # shutting down (SIGTERM): routers drain it

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting + self.num_reservations


StreamItem = KVEvent | KVDigest | LoadReport


@dataclass(frozen=True, slots=True)
class Numbered:
    """One item of a subscription: an event numbered `seq`, or a digest or load report taken
    right after event `seq` (they do not advance the numbering)."""

    seq: int
    item: StreamItem


class KVEventBroadcaster:
    """Numbers the engine's KV events and fans them out to subscribers (the routers' streams),
    with digests and load reports between them. `publish` never blocks: a subscriber that falls
    `max_backlog` items behind is dropped (it receives None and must resubscribe).

    Thread-safe; one lock orders numbering, the replay buffer and the fan-out, so every
    subscriber sees items in publication order. The engine thread publishes; `subscribe` must
    run there too when its caller takes a snapshot of the published set with it.
    """

    def __init__(self, max_backlog: int = 10_000, replay_events: int = 1024) -> None:
        self.epoch = secrets.randbits(63) | 1  # never 0: 0 asks for a snapshot
        self._subscribers: list[queue.Queue[Numbered | None]] = []
        self._lock = threading.Lock()
        self._max_backlog = max_backlog
        self._replay: deque[Numbered] = deque(maxlen=replay_events)
        self._seq = 0
        self._digest = KVDigest()

    @property
    def seq(self) -> int:
        """The number of the last event published (0: none yet)."""
        return self._seq

    @property
    def digest(self) -> KVDigest:
        """The digest of the set the published events describe."""
        return self._digest

    def subscribe(
        self, epoch: int = 0, after_seq: int = 0
    ) -> "tuple[list[Numbered] | None, queue.Queue[Numbered | None]]":
        """A subscription to every later item, with the events after `after_seq` of `epoch`
        when the replay buffer still holds them all (else None: the caller sends a snapshot
        numbered `seq` first)."""
        subscriber: queue.Queue[Numbered | None] = queue.Queue(self._max_backlog)
        with self._lock:
            self._subscribers.append(subscriber)
            return self._replayed(epoch, after_seq), subscriber

    def unsubscribe(self, subscriber: "queue.Queue[Numbered | None]") -> None:
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
        """Number `event`, keep it for replay and send it to every subscriber."""
        with self._lock:
            self._seq += 1
            if isinstance(event, BlockStored):
                self._digest = self._digest.changed(event.block_hashes, ())
            else:
                self._digest = self._digest.changed((), event.block_hashes)
            numbered = Numbered(self._seq, event)
            self._replay.append(numbered)
            self._fan_out(numbered)

    def report(self, item: KVDigest | LoadReport) -> None:
        """Send a digest or load report, numbered after the last event, to every subscriber."""
        with self._lock:
            self._fan_out(Numbered(self._seq, item))

    def has_subscribers(self) -> bool:
        return bool(self._subscribers)

    # -- internals: callers hold the lock ------------------------------------------------------

    def _replayed(self, epoch: int, after_seq: int) -> list[Numbered] | None:
        if epoch != self.epoch or after_seq > self._seq:
            return None
        if after_seq == self._seq:
            return []
        if not self._replay or self._replay[0].seq > after_seq + 1:
            return None  # some of them left the buffer
        return [numbered for numbered in self._replay if numbered.seq > after_seq]

    def _fan_out(self, numbered: Numbered) -> None:
        for subscriber in list(self._subscribers):
            try:
                subscriber.put_nowait(numbered)
            except queue.Full:
                self._subscribers.remove(subscriber)
                _end(subscriber)


def _end(subscriber: "queue.Queue[Numbered | None]") -> None:
    """Put the None that ends a subscription, dropping older items to make room (it ends, so
    they no longer matter; the engine thread may still be publishing into it)."""
    while True:
        try:
            subscriber.put_nowait(None)
            return
        except queue.Full:
            with contextlib.suppress(queue.Empty):
                subscriber.get_nowait()

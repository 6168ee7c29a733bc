"""The router's background views of its instances, each on its own daemon threads.

- `KVEventFollower`: one thread per instance follows its KV-event stream (pdserve.kvcache.events):
  its published blocks into the `KVEventIndex` the routing policies read, its load reports for
  the policies, and the route numbers those reports acknowledge for the load tracker. Any item
  also shows the instance alive (healthy).
- `StatsPoller`: with conditional disaggregation, one thread polls every instance's stats (their
  step time models).

Both stop with `stop()`; neither raises into its thread: a broken stream or a failed poll drops
that instance's view until it answers again.

The follower checks every item's numbering against the events it applied (`_Cursor`): an event
not numbered next (a gap, or one seen again), an item out of order, an item of another epoch
(the instance restarted) or a digest that disagrees with the copy in the index ends the stream
and resubscribes at once (`_Resync`). A gap or a repeat resumes after the last event applied
(the instance replays what its buffer holds, else sends a snapshot); a new epoch or a drifted
digest asks for a snapshot. Each resync is counted by reason.
"""

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.errors import PdserveError
from pdserve.instance.convert import load_from_proto
from pdserve.kvcache.events import BlockRemoved, BlockStored, KVDigest, LoadReport
from pdserve.kvcache.hashing import BlockHash
from pdserve.metrics import RouterMetrics
from pdserve.v1 import common_pb2
from services.router.kv_index import KVEventIndex
from services.router.membership import Membership, Role
from services.router.pd_client import PDClient

logger = logging.getLogger(__name__)

RESUBSCRIBE_S = 1.0


class _Threads:
    def __init__(self) -> None:
        self.stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        with self._lock:
            # those of forgotten instances have ended: one per restart would pile up
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)

    def stop(self) -> None:
        self.stopped.set()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(5)

    def alive(self) -> bool:
        with self._lock:
            return any(thread.is_alive() for thread in self._threads)


@dataclass(slots=True)
class _Cursor:
    """Where the index's copy of an instance stands: after event `seq` of `epoch`."""

    epoch: int
    seq: int


class _Resync(Exception):
    """The stream cannot be applied on: resubscribe (after the cursor, or from a snapshot)."""

    def __init__(self, reason: str, snapshot: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.snapshot = snapshot


class KVEventFollower:
    """Keeps `index` equal to the KV caches of the followed instances, and their last load
    reports in `load`. `on_acknowledged(address, seq)`: a report of `address` counts this
    router's attempts up to route number `seq` (this router: output subscriber
    `subscriber`)."""

    def __init__(
        self,
        membership: Membership,
        client: PDClient,
        metrics: RouterMetrics,
        on_acknowledged: Callable[[str, int], None] = lambda address, seq: None,
        index: KVEventIndex | None = None,
    ) -> None:
        self.index = index or KVEventIndex()
        self._membership = membership
        self._client = client
        self._metrics = metrics
        self.on_acknowledged = on_acknowledged
        self._subscriber = client.outputs.subscriber
        self._threads = _Threads()
        # each followed instance's token: its thread follows while the token is current (a
        # forgotten instance followed again gets a new thread, the old one ends)
        self._followed: dict[str, object] = {}
        self._streams: dict[str, Any] = {}  # each followed instance's open stream
        self._cursors: dict[str, _Cursor] = {}  # where each instance's copy stands
        self._epochs: dict[str, int] = {}  # each instance's last epoch seen (kept across drops)
        self._loads: dict[str, LoadReport] = {}  # each instance's last load report
        self._lock = threading.Lock()

    def follow(self, address: str) -> None:
        """Follow `address`'s stream until `forget` (or `stop`)."""
        token = object()
        with self._lock:
            self._followed[address] = token
        self._threads.spawn(self._follow, address, token)

    def forget(self, address: str) -> None:
        """Drop `address`'s view now and end its subscription."""
        with self._lock:
            self._followed.pop(address, None)
            self._epochs.pop(address, None)
            stream = self._streams.pop(address, None)
        if stream is not None:
            stream.cancel()
        self._drop(address)

    def stop(self) -> None:
        """End every subscription now (a thread waiting for its next event is woken)."""
        self._threads.stopped.set()
        with self._lock:
            for stream in self._streams.values():
                stream.cancel()
        self._threads.stop()

    def alive(self) -> bool:
        """Some subscription's thread still runs."""
        return self._threads.alive()

    def load(self, address: str) -> LoadReport | None:
        """The instance's last load report, while its stream is up."""
        return self._loads.get(address)

    def _following(self, address: str, token: object) -> bool:
        return not self._threads.stopped.is_set() and self._followed.get(address) is token

    def _follow(self, address: str, token: object) -> None:
        """Subscribe (resuming after the cursor when there is one) and apply the stream; on a
        resync subscribe again at once, on a broken stream drop the view and retry after
        RESUBSCRIBE_S."""
        while self._following(address, token):
            cursor = self._cursors.get(address)
            resume = (cursor.epoch, cursor.seq) if cursor is not None else (0, 0)
            stream = self._client.instance(address).kv_events(*resume)
            with self._lock:
                self._streams[address] = stream
            if not self._following(address, token):
                stream.cancel()  # `stop` or `forget` came between the check and here
            resync: _Resync | None = None
            try:
                for message in stream:
                    if not self._following(address, token):
                        stream.cancel()
                        break
                    self._apply(address, message)
            except _Resync as e:
                stream.cancel()
                resync = e
            except grpc.RpcError:
                pass
            with self._lock:
                if self._streams.get(address) is stream:
                    del self._streams[address]
            if not self._following(address, token):
                return  # a newer thread (or none) keeps the view
            if resync is not None:
                self._resynced(address, resync)
                continue
            self._metrics.kv_index_resyncs.labels("disconnect").inc()
            self._drop(address)
            self._threads.stopped.wait(RESUBSCRIBE_S)

    def _resynced(self, address: str, resync: _Resync) -> None:
        self._metrics.kv_index_resyncs.labels(resync.reason).inc()
        logger.info("the KV-event stream of %s resyncs (%s) from %s", address, resync.reason,
                    "a snapshot" if resync.snapshot else "its last event")  # fmt: skip
        if resync.snapshot:
            self._cursors.pop(address, None)

    def _drop(self, address: str) -> None:
        """The stream is gone: forget the instance's blocks, load and cursor."""
        self._cursors.pop(address, None)
        self._loads.pop(address, None)
        self.index.drop_instance(address)

    def _apply(self, address: str, message: common_pb2.KVEvent) -> None:
        """Apply one item of the stream, or raise _Resync."""
        kind = message.WhichOneof("event")
        if kind == "snapshot":
            self._apply_snapshot(address, message)
        else:
            cursor = self._checked(address, message, kind == "stored" or kind == "removed")
            if kind == "stored":
                hashes = tuple(BlockHash(h) for h in message.stored.block_hashes)
                self.index.apply(address, BlockStored(hashes))
            elif kind == "removed":
                hashes = tuple(BlockHash(h) for h in message.removed.block_hashes)
                self.index.apply(address, BlockRemoved(hashes))
            elif kind == "digest":
                reported = KVDigest(message.digest.num_blocks, message.digest.hash_sum)
                if self.index.digest(address) != reported:
                    raise _Resync("digest", snapshot=True)
            elif kind == "load":
                self._apply_load(address, message.load)
            cursor.seq = message.seq
        self._membership.mark_healthy(address)

    def _apply_snapshot(self, address: str, message: common_pb2.KVEvent) -> None:
        known = self._epochs.get(address)
        if known is not None and known != message.epoch:
            self._metrics.kv_index_resyncs.labels("epoch").inc()  # it restarted while away
        self._metrics.kv_index_snapshots.inc()
        hashes = tuple(BlockHash(h) for h in message.snapshot.block_hashes)
        self.index.replace_instance(address, hashes)
        self._cursors[address] = _Cursor(message.epoch, message.seq)
        self._epochs[address] = message.epoch

    def _checked(self, address: str, message: common_pb2.KVEvent, event: bool) -> _Cursor:
        """The cursor `message` applies at: an event must be numbered next, a report taken
        after the last event applied."""
        cursor = self._cursors.get(address)
        if cursor is None or message.epoch != cursor.epoch:
            raise _Resync("epoch", snapshot=True)
        expected = cursor.seq + 1 if event else cursor.seq
        if message.seq > expected:
            raise _Resync("gap", snapshot=False)
        if message.seq < expected:
            raise _Resync("duplicate" if event else "reorder", snapshot=False)
        return cursor

    def _apply_load(self, address: str, load: common_pb2.InstanceLoad) -> None:
        self._loads[address] = load_from_proto(load)
        if load.leaving and not self._membership.is_leaving(address):
            logger.warning("instance %s is shutting down: drained", address)
            self._membership.set_leaving(address)
        acknowledged = load.received.get(self._subscriber, 0)
        if acknowledged:
            self.on_acknowledged(address, acknowledged)


class StatsPoller:
    """Every `interval_s`, each prefill and decode instance's stats (`stats`): conditional
    disaggregation compares both sides' step time models."""

    def __init__(self, membership: Membership, client: PDClient, interval_s: float) -> None:
        self._membership = membership
        self._client = client
        self._interval_s = interval_s
        self._stats: dict[str, common_pb2.InstanceStats] = {}
        self._threads = _Threads()

    def start(self) -> None:
        self._threads.spawn(self._poll)

    def stop(self) -> None:
        self._threads.stop()

    def stats(self, address: str) -> common_pb2.InstanceStats | None:
        """The instance's last stats, when it answered its last poll."""
        return self._stats.get(address)

    def _poll(self) -> None:
        while not self._threads.stopped.wait(self._interval_s):
            for role in (Role.DECODE, Role.PREFILL):
                for address in self._membership.members(role):
                    self._poll_one(address)

    def _poll_one(self, address: str) -> None:
        try:
            self._stats[address] = self._client.instance(address).stats()
        except PdserveError:
            self._stats.pop(address, None)

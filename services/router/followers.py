"""The router's background views of its instances, each on its own daemon threads.

- `KVEventFollower`: one thread per prefill (or mixed) instance mirrors its KV events into the
  `KVEventIndex` the routing policy reads; an event also shows the instance alive (healthy).
- `DecodeLoadPoller`: one thread polls every decode instance's free blocks and running requests
  for the decode policy.

Both stop with `stop()`; neither raises into its thread: a broken stream or a failed poll drops
that instance's view until it answers again.
"""

import threading
from collections.abc import Callable
from typing import Any

import grpc

from pdserve.errors import PdserveError
from pdserve.kvcache.events import BlockRemoved, BlockStored
from pdserve.kvcache.hashing import BlockHash
from pdserve.v1 import common_pb2
from services.router.kv_index import KVEventIndex
from services.router.membership import Membership, Role
from services.router.pd_client import PDClient
from services.router.policies import DecodeCapacity

RESUBSCRIBE_S = 1.0


class _Threads:
    def __init__(self) -> None:
        self.stopped = threading.Event()
        self._threads: list[threading.Thread] = []

    def spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        self.stopped.set()
        for thread in self._threads:
            thread.join(5)

    def alive(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)


class KVEventFollower:
    """Keeps `index` equal to the KV caches of the followed instances."""

    def __init__(
        self,
        membership: Membership,
        client: PDClient,
        index: KVEventIndex | None = None,
    ) -> None:
        self.index = index or KVEventIndex()
        self._membership = membership
        self._client = client
        self._threads = _Threads()
        # each followed instance's token: its thread follows while the token is current (a
        # forgotten instance followed again gets a new thread, the old one ends)
        self._followed: dict[str, object] = {}
        self._streams: dict[str, Any] = {}  # each followed instance's open stream
        self._lock = threading.Lock()

    def follow(self, address: str) -> None:
        """Mirror `address`'s KV events until `forget` (or `stop`)."""
        token = object()
        with self._lock:
            self._followed[address] = token
        self._threads.spawn(self._follow, address, token)

    def forget(self, address: str) -> None:
        """Drop `address`'s view now and end its subscription."""
        with self._lock:
            self._followed.pop(address, None)
            stream = self._streams.pop(address, None)
        if stream is not None:
            stream.cancel()
        self.index.drop_instance(address)

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

    def _following(self, address: str, token: object) -> bool:
        return not self._threads.stopped.is_set() and self._followed.get(address) is token

    def _follow(self, address: str, token: object) -> None:
        """Each subscription starts with a snapshot that replaces the view, then live events.
        On disconnect drop the view and resubscribe."""
        while self._following(address, token):
            stream = self._client.instance(address).kv_events()
            with self._lock:
                self._streams[address] = stream
            if not self._following(address, token):
                stream.cancel()  # `stop` or `forget` came between the check and here
            try:
                for event in stream:
                    if not self._following(address, token):
                        stream.cancel()
                        break
                    self._apply(address, event)
            except grpc.RpcError:
                pass
            with self._lock:
                if self._streams.get(address) is stream:
                    del self._streams[address]
            if not self._following(address, token):
                return  # a newer thread (or none) keeps the view
            self.index.drop_instance(address)
            self._threads.stopped.wait(RESUBSCRIBE_S)

    def _apply(self, address: str, event: common_pb2.KVEvent) -> None:
        self._membership.mark_healthy(address)
        kind = event.WhichOneof("event")
        if kind == "snapshot":
            hashes = tuple(BlockHash(h) for h in event.snapshot.block_hashes)
            self.index.replace_instance(address, hashes)
        elif kind == "stored":
            hashes = tuple(BlockHash(h) for h in event.stored.block_hashes)
            self.index.apply(address, BlockStored(hashes))
        elif kind == "removed":
            hashes = tuple(BlockHash(h) for h in event.removed.block_hashes)
            self.index.apply(address, BlockRemoved(hashes))


class DecodeLoadPoller:
    """Every `interval_s`, each decode instance's capacity (`capacities`) and stats (`stats`);
    with `prefill_too`, the prefill instances' stats as well (conditional disaggregation
    compares both sides' step time models)."""

    def __init__(
        self,
        membership: Membership,
        client: PDClient,
        interval_s: float,
        prefill_too: bool = False,
    ) -> None:
        self._membership = membership
        self._client = client
        self._interval_s = interval_s
        self._roles = (Role.DECODE, Role.PREFILL) if prefill_too else (Role.DECODE,)
        self._capacities: dict[str, DecodeCapacity] = {}
        self._stats: dict[str, common_pb2.InstanceStats] = {}
        self._threads = _Threads()

    def start(self) -> None:
        self._threads.spawn(self._poll)

    def stop(self) -> None:
        self._threads.stop()

    def capacities(self) -> dict[str, DecodeCapacity]:
        """The last answer of each decode instance that answered its last poll (a copy)."""
        return dict(self._capacities)

    def stats(self, address: str) -> common_pb2.InstanceStats | None:
        """The instance's last stats, when it answered its last poll."""
        return self._stats.get(address)

    def _poll(self) -> None:
        while not self._threads.stopped.wait(self._interval_s):
            for role in self._roles:
                for address in self._membership.members(role):
                    self._poll_one(address, role)

    def _poll_one(self, address: str, role: Role) -> None:
        try:
            stats = self._client.instance(address).stats()
        except PdserveError:
            self._capacities.pop(address, None)
            self._stats.pop(address, None)
            return
        self._stats[address] = stats
        if role == Role.DECODE:
            self._capacities[address] = DecodeCapacity(stats.num_free_blocks, stats.num_running)

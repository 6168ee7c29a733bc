"""LoadTracker: the router's own count of in-flight requests and prefill tokens per instance,
and of those the instances have not acknowledged yet.

Every routed request takes a `Lease` on the instance it was sent to and releases it exactly once
on every exit path (success, error, client disconnect, timeout, retry): use it as a context
manager, or call `release()` in a `finally`. A second `release()` is a no-op, so an error path
that releases early and an outer `with` that releases again cannot drive a counter negative.

The counters are the router's view, updated at decision time; they need no round trip to the
instance, so they are exact for requests routed by this router and blind to anything else.
What the routing policies weigh is the instances' own load reports (every router's requests)
plus `pending`: this router's live leases whose attempt number (`route_seq`, shared by an
attempt's leases) the instance has not acknowledged in a report yet. A lease that is never
acknowledged stops counting there after `PENDING_MAX_S`, so a leaked lease cannot skew routing.

Locking: one `threading.Lock` per tracker guards the counters and the set of live leases; every
public method holds it for its whole (constant-time) body. A `Lease`'s state is guarded by its
tracker's lock.
"""

import threading
import time
from dataclasses import dataclass
from types import TracebackType

from pdserve.errors import IntegrityError


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """What the router has in flight on one instance."""

    in_flight_requests: int = 0
    in_flight_prefill_tokens: int = 0


IDLE = InstanceLoad()
"""The load of an instance with no live lease."""

PENDING_MAX_S = 5.0
"""How long a lease the instance has not acknowledged counts as pending: an instance admits a
request within milliseconds of its arrival; one not acknowledged by then was lost on the way."""


class Lease:
    """One request's hold on one instance; created only by `LoadTracker.acquire`.

    `release()` gives back the request and its remaining prefill tokens; `finish_prefill()` gives
    back only the prefill tokens (the prompt has been computed, the request is still running).
    Both are idempotent and thread-safe.
    """

    __slots__ = (
        "_outstanding_prefill_tokens",
        "_released",
        "_tracker",
        "acquired_at",
        "instance_id",
        "prefill_tokens",
        "seq",
    )

    def __init__(
        self, tracker: "LoadTracker", instance_id: str, prefill_tokens: int, seq: int
    ) -> None:
        self._tracker = tracker
        self.instance_id = instance_id
        self.prefill_tokens = prefill_tokens
        self.seq = seq  # the attempt's route number (0: none)
        self.acquired_at = time.monotonic()
        self._outstanding_prefill_tokens = prefill_tokens
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> bool:
        """Release the lease. Returns True on the call that released it, False on any later one."""
        return self._tracker._release(self)

    def finish_prefill(self) -> bool:
        """Stop counting this lease's prefill tokens. Returns True if this call changed a counter
        (False if already finished or released)."""
        return self._tracker._finish_prefill(self)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "live"
        return f"Lease({self.instance_id!r}, prefill_tokens={self.prefill_tokens}, {state})"


class LoadTracker:
    """Per-instance in-flight requests and in-flight prefill tokens, counted through leases.

    Loads are kept as frozen `InstanceLoad` values, replaced on every change, so that `snapshot`
    (on every routing decision) is a plain dict copy.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loads: dict[str, InstanceLoad] = {}  # only instances with a live lease
        self._live: set[Lease] = set()
        self._seq = 0  # the last route number given out
        # per instance: the live leases it has not acknowledged, in route number order, each
        # with the prefill tokens it counts in `_pending`
        self._unacked: dict[str, dict[Lease, int]] = {}
        self._pending: dict[str, InstanceLoad] = {}
        self._acked: dict[str, int] = {}  # per instance: the highest route number acknowledged

    def next_seq(self) -> int:
        """A new route number (increasing): an attempt's leases share one."""
        with self._lock:
            self._seq += 1
            return self._seq

    def acquire(self, instance_id: str, prefill_tokens: int, seq: int = 0) -> Lease:
        """Count one more request and `prefill_tokens` more prefill tokens on `instance_id`,
        pending there until the instance acknowledges route number `seq` (0: at once).

        Raises ValueError if `prefill_tokens` is negative (a caller bug). Takes the lock.
        """
        if prefill_tokens < 0:
            raise ValueError(f"prefill_tokens must be >= 0, got {prefill_tokens}")
        lease = Lease(self, instance_id, prefill_tokens, seq)
        with self._lock:
            self._add(instance_id, 1, prefill_tokens)
            self._live.add(lease)
            if seq > self._acked.get(instance_id, 0):
                self._unacked.setdefault(instance_id, {})[lease] = prefill_tokens
                self._add_pending(instance_id, 1, prefill_tokens)
        return lease

    def acknowledge(self, instance_id: str, seq: int) -> None:
        """`instance_id` reported a load that counts this router's attempts up to route
        number `seq`: its leases numbered so far stop being pending. Takes the lock."""
        with self._lock:
            if seq <= self._acked.get(instance_id, 0):
                return
            self._acked[instance_id] = seq
            unacked = self._unacked.get(instance_id, {})
            for lease in list(unacked):
                if lease.seq > seq:
                    break
                self._settle(instance_id, lease)

    def pending(self, instance_id: str) -> InstanceLoad:
        """This router's requests on `instance_id` it has not acknowledged yet (those older
        than PENDING_MAX_S excepted). Takes the lock."""
        with self._lock:
            unacked = self._unacked.get(instance_id)
            if unacked:
                stale = time.monotonic() - PENDING_MAX_S
                for lease in list(unacked):
                    if lease.acquired_at > stale:
                        break
                    self._settle(instance_id, lease)
            return self._pending.get(instance_id, IDLE)

    def load_of(self, instance_id: str) -> InstanceLoad:
        """The current load of one instance (`IDLE` if it has no live lease). Takes the lock."""
        with self._lock:
            return self._loads.get(instance_id, IDLE)

    def snapshot(self) -> dict[str, InstanceLoad]:
        """Loads of every instance holding at least one live lease; absent instances are idle.

        Returns a new dict of frozen values (safe to keep); takes the lock.
        """
        with self._lock:
            return dict(self._loads)

    def check_integrity(self) -> None:
        """Raise IntegrityError unless no counter is negative, every instance's load equals
        the sum over its live leases (an instance with no live lease has no entry) and its
        pending load the sum over its unacknowledged live leases. Takes the lock."""
        with self._lock:
            expected: dict[str, InstanceLoad] = {}
            for lease in self._live:
                if lease.released:
                    raise IntegrityError(f"{lease!r} is released but still counted")
                load = expected.get(lease.instance_id, IDLE)
                expected[lease.instance_id] = InstanceLoad(
                    load.in_flight_requests + 1,
                    load.in_flight_prefill_tokens + lease._outstanding_prefill_tokens,
                )
            for instance_id, load in self._loads.items():
                if load.in_flight_requests < 0 or load.in_flight_prefill_tokens < 0:
                    raise IntegrityError(f"{instance_id}: negative in-flight load {load}")
            if self._loads != expected:
                raise IntegrityError(f"loads {self._loads} != sums over live leases {expected}")
            pending = {
                instance_id: InstanceLoad(len(unacked), sum(unacked.values()))
                for instance_id, unacked in self._unacked.items()
            }
            if self._pending != pending or any(
                lease not in self._live for unacked in self._unacked.values() for lease in unacked
            ):
                raise IntegrityError(f"pending {self._pending} != unacknowledged leases {pending}")

    # -- internals: callers hold the lock ------------------------------------------------------

    def _add(self, instance_id: str, requests: int, prefill_tokens: int) -> None:
        _count(self._loads, instance_id, requests, prefill_tokens)

    def _add_pending(self, instance_id: str, requests: int, prefill_tokens: int) -> None:
        _count(self._pending, instance_id, requests, prefill_tokens)

    def _settle(self, instance_id: str, lease: Lease) -> None:
        """The lease stops being pending (acknowledged, stale or released)."""
        unacked = self._unacked[instance_id]
        self._add_pending(instance_id, -1, -unacked.pop(lease))
        if not unacked:
            del self._unacked[instance_id]

    def _release(self, lease: Lease) -> bool:
        with self._lock:
            if lease._released:
                return False
            lease._released = True
            self._live.discard(lease)
            if lease in self._unacked.get(lease.instance_id, ()):
                self._settle(lease.instance_id, lease)
            self._add(lease.instance_id, -1, -lease._outstanding_prefill_tokens)
            lease._outstanding_prefill_tokens = 0
            return True

    def _finish_prefill(self, lease: Lease) -> bool:
        with self._lock:
            if lease._released or not lease._outstanding_prefill_tokens:
                return False
            self._add(lease.instance_id, 0, -lease._outstanding_prefill_tokens)
            lease._outstanding_prefill_tokens = 0
            return True


def _count(loads: dict[str, InstanceLoad], instance_id: str, requests: int, tokens: int) -> None:
    """Add to an instance's load in `loads`; an instance left with no request has no entry."""
    load = loads.get(instance_id, IDLE)
    num_requests = load.in_flight_requests + requests
    if num_requests:
        loads[instance_id] = InstanceLoad(num_requests, load.in_flight_prefill_tokens + tokens)
    else:
        del loads[instance_id]

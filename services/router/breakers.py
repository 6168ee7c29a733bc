"""Circuit breakers: one per instance, so that an instance that keeps failing stops taking
traffic even while it is alive (its KV-event stream up, the supervisor content).

A breaker is *closed* while its instance serves: every failure blamed on the instance counts,
every success resets the count. `failures` consecutive failures *open* it: the routing skips the
instance for `cooldown_s`. Then it lets one request through as a probe (*half-open*): its
success closes the breaker, its failure opens it again for twice the last cool-down (at most
`MAX_COOLDOWN_FACTOR` times the configured one). A probe that reports nothing within a
cool-down (its client went away) lets the next request probe.

Thread-safe: one lock; every method holds it for its whole (constant-time) body. The clock is
injectable for tests.
"""

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum

MAX_COOLDOWN_FACTOR = 8


class BreakerState(IntEnum):
    """A breaker's state (the value is its gauge's)."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


@dataclass(slots=True)
class _Breaker:
    failures: int = 0  # consecutive, while closed
    state: BreakerState = BreakerState.CLOSED
    until: float = 0.0  # open: when the cool-down ends; half-open: when the probe expires
    cooldown_s: float = 0.0  # the cool-down it opened for last


class CircuitBreakers:
    """The breakers of every instance routed to. `failures` 0 disables them (all closed)."""

    def __init__(
        self,
        failures: int,
        cooldown_s: float,
        on_change: Callable[[str, BreakerState], None] = lambda address, state: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`on_change(address, state)`: called (under the lock: must not block) when a
        breaker changes state."""
        self.failures = failures
        self.cooldown_s = cooldown_s
        self._on_change = on_change
        self._clock = clock
        self._lock = threading.Lock()
        self._breakers: dict[str, _Breaker] = {}  # only instances that failed since closing

    def admitted(self, candidates: Iterable[str]) -> list[str]:
        """The candidates a request may be sent to now: closed breakers, and those whose
        cool-down ended with no probe in flight."""
        with self._lock:
            now = self._clock()
            return [address for address in candidates if self._admits(address, now)]

    def sent(self, address: str) -> None:
        """A request was sent to `address`: if its cool-down has ended, it is the probe."""
        with self._lock:
            breaker = self._breakers.get(address)
            if breaker is not None and breaker.state != BreakerState.CLOSED:
                now = self._clock()
                if self._admits(address, now):
                    breaker.state = BreakerState.HALF_OPEN
                    breaker.until = now + breaker.cooldown_s
                    self._on_change(address, BreakerState.HALF_OPEN)

    def succeeded(self, address: str) -> None:
        """A request on `address` succeeded: its breaker closes."""
        with self._lock:
            breaker = self._breakers.pop(address, None)
            if breaker is not None and breaker.state != BreakerState.CLOSED:
                self._on_change(address, BreakerState.CLOSED)

    def failed(self, address: str) -> None:
        """A failure was blamed on `address`: counted; the breaker opens at `failures` in a
        row, or again when it was probing."""
        if self.failures <= 0:
            return
        with self._lock:
            breaker = self._breakers.setdefault(address, _Breaker())
            if breaker.state == BreakerState.OPEN:
                return  # a request sent before it opened: the cool-down stands
            if breaker.state == BreakerState.HALF_OPEN:
                limit = self.cooldown_s * MAX_COOLDOWN_FACTOR
                self._open(address, breaker, min(limit, 2 * breaker.cooldown_s))
                return
            breaker.failures += 1
            if breaker.failures >= self.failures:
                self._open(address, breaker, self.cooldown_s)

    def state(self, address: str) -> BreakerState:
        with self._lock:
            breaker = self._breakers.get(address)
            return breaker.state if breaker is not None else BreakerState.CLOSED

    def retry_after_s(self, candidates: Iterable[str]) -> float:
        """How long until one of `candidates` admits a request again (0: one does now)."""
        with self._lock:
            now = self._clock()
            waits = [
                max(0.0, breaker.until - now) if breaker.state != BreakerState.CLOSED else 0.0
                for address in candidates
                if (breaker := self._breakers.get(address)) is not None
            ]
            return min(waits, default=0.0)

    def forget(self, address: str) -> None:
        """`address` left the cluster (or was replaced): no breaker."""
        with self._lock:
            if self._breakers.pop(address, None) is not None:
                self._on_change(address, BreakerState.CLOSED)

    # -- internals: callers hold the lock ------------------------------------------------------

    def _admits(self, address: str, now: float) -> bool:
        breaker = self._breakers.get(address)
        return breaker is None or breaker.state == BreakerState.CLOSED or now >= breaker.until

    def _open(self, address: str, breaker: _Breaker, cooldown_s: float) -> None:
        breaker.state = BreakerState.OPEN
        breaker.failures = 0
        breaker.cooldown_s = cooldown_s
        breaker.until = self._clock() + cooldown_s
        self._on_change(address, BreakerState.OPEN)

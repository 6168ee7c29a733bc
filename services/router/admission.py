"""AdmissionQueue: requests wait at the router, in order of priority and fairly across users,
while the cluster is saturated; beyond the queue's bounds they get 429 with Retry-After.

A request passes at once when nobody queues and the cluster has room (`saturated` says whether
it has none: the router's concurrency limit, every prefill candidate's waiting requests, every
candidate's free blocks for the prompt). Otherwise it takes a place in the queue, unless
`queue_max_requests` wait already (429 `queue_full`), and waits at most `queue_timeout_s` (429
`queue_timeout`). `pump` lets the next one through while the cluster has room: the router
calls it when a request has been routed (its leases taken, so the next check counts it), when
one ends, and every `PUMP_INTERVAL_S` while anybody waits (load reports free room too).

Order: the lowest `priority` first (vLLM's convention; default 0); among equal priorities the
users take turns (round robin over the users with requests waiting, each user's own requests
first come first served), so one user's flood cannot starve another's requests. A user is the
API key's name, else the request's `user` field.

Runs on the router's event loop (not thread-safe): every method is called there.
"""

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.errors import RateLimitedError
from pdserve.metrics import RouterMetrics

PUMP_INTERVAL_S = 0.01


@dataclass(eq=False, slots=True)
class _Waiter:
    user: str
    priority: int
    prompt_tokens: int
    generations: int
    arrived: float
    future: "asyncio.Future[None]" = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class AdmissionQueue:
    def __init__(
        self,
        max_requests: int,
        timeout_s: float,
        saturated: Callable[[int, int], bool],
        metrics: RouterMetrics,
    ) -> None:
        """`saturated(generations, prompt_tokens)`: whether the cluster has no room for
        `generations` more of a prompt of `prompt_tokens` tokens."""
        self.max_requests = max_requests
        self.timeout_s = timeout_s
        self._saturated = saturated
        self._metrics = metrics
        # priority -> user -> that user's waiters, oldest first; users in turn order
        self._bands: dict[int, OrderedDict[str, deque[_Waiter]]] = {}
        self._length = 0
        self._ticker: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return self._length

    async def enter(
        self, user: str, priority: int, prompt_tokens: int, generations: int = 1, key: str = ""
    ) -> None:
        """Return when the request may be routed. Raises RateLimitedError when the queue is full
        or the request waited `timeout_s` (`key`: the API key's name, a metric label)."""
        if not self._length and not self._saturated(generations, prompt_tokens):
            return
        if self._length >= self.max_requests:
            self._reject("queue_full", key)
            raise RateLimitedError(
                f"the router's admission queue is full ({self.max_requests} requests wait: "
                "router.queue_max_requests) while every instance is saturated; retry later",
                1000,
            )
        waiter = _Waiter(user, priority, prompt_tokens, generations, time.perf_counter())
        self._add(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), self.timeout_s)
        except TimeoutError:
            self._reject("queue_timeout", key)
            raise RateLimitedError(
                f"the request waited {self.timeout_s:g} s in the router's admission queue "
                "(router.queue_timeout_s) while every instance was saturated; retry later",
                max(1000, round(self.timeout_s * 1000)),
            ) from None
        finally:
            if not waiter.future.done():  # timed out, or its client went away
                self._remove(waiter)
                waiter.future.cancel()
        self._metrics.queue_wait.observe(time.perf_counter() - waiter.arrived)

    def pump(self) -> None:
        """Let the next waiter through if the cluster has room for it."""
        waiter = self._next()
        if waiter is None or self._saturated(waiter.generations, waiter.prompt_tokens):
            return
        self._remove(waiter, served=True)
        waiter.future.set_result(None)

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None

    # -- internals ------------------------------------------------------------------------------

    def _reject(self, reason: str, key: str) -> None:
        self._metrics.rejections.labels(reason, key).inc()

    def _add(self, waiter: _Waiter) -> None:
        users = self._bands.setdefault(waiter.priority, OrderedDict())
        users.setdefault(waiter.user, deque()).append(waiter)
        self._length += 1
        self._metrics.queue_length.set(self._length)
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.ensure_future(self._tick())

    def _next(self) -> _Waiter | None:
        """The waiter whose turn it is: the lowest priority band, its first user in turn."""
        if not self._bands:
            return None
        users = self._bands[min(self._bands)]
        return users[next(iter(users))][0]

    def _remove(self, waiter: _Waiter, served: bool = False) -> None:
        """Take `waiter` out of the queue; `served`: it was let through, so its user's turn
        passes (the user goes to the back of its band)."""
        users = self._bands.get(waiter.priority)
        own = users.get(waiter.user) if users is not None else None
        if users is None or own is None or waiter not in own:
            return
        own.remove(waiter)
        if not own:
            del users[waiter.user]
        elif served:
            users.move_to_end(waiter.user)
        if not users:
            del self._bands[waiter.priority]
        self._length -= 1
        self._metrics.queue_length.set(self._length)

    async def _tick(self) -> None:
        """Pump every PUMP_INTERVAL_S while anybody waits (room frees without a request of
        this router ending: another router's requests end, load reports arrive)."""
        while self._length:
            await asyncio.sleep(PUMP_INTERVAL_S)
            self.pump()

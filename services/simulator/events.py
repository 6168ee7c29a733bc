"""Simulated time: actions scheduled at instants, run in time order (ties in the order they
were scheduled). Both simulations (hit rates, latency) run on one."""

import heapq
import itertools
import math
from collections.abc import Callable, Iterator

Action = Callable[[], object]


class EventQueue:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self._heap: list[tuple[float, int, Action]] = []
        self._seq = itertools.count()

    def at(self, time_s: float, action: Action) -> None:
        heapq.heappush(self._heap, (time_s, next(self._seq), action))

    def advance(self, until_s: float, done: Callable[[], bool] = lambda: False) -> None:
        """Run every action due by `until_s` (each may schedule more), stopping early once
        `done()` after one; then the clock reads `until_s` (unless infinite)."""
        heap = self._heap
        while heap and heap[0][0] <= until_s:
            time_s, _, action = heapq.heappop(heap)
            self.now = max(self.now, time_s)
            action()
            if done():
                return
        if until_s != math.inf:
            self.now = max(self.now, until_s)

    def actions(self) -> Iterator[Action]:
        """The actions still scheduled (in no particular order)."""
        return (action for _, _, action in self._heap)

"""The restart budget of a process pdserve keeps alive (an instance, a router replica).

A process that dies is started again, at most `cluster.max_restarts` times within
`cluster.restart_window_s`: a crash loop is given up, a rare loss is always healed, however
many came before it (None: a budget for the process's lifetime).
"""

import time
from collections.abc import Callable


class RestartBudget:
    """When each restart of one process was tried, within the window."""

    def __init__(
        self,
        max_restarts: int,
        window_s: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_restarts = max_restarts
        self._window_s = window_s
        self._clock = clock
        self._tries: list[float] = []

    def spend(self) -> bool:
        """Count a try now (whether it will succeed or fail); False, counting nothing, when
        `max_restarts` were tried within the window already."""
        now = self._clock()
        if self._window_s is not None:
            self._tries = [t for t in self._tries if now - t < self._window_s]
        if len(self._tries) >= self._max_restarts:
            return False
        self._tries.append(now)
        return True

    def spent_text(self) -> str:
        """Why the budget is spent, for the operator: '2 restarts tried in the last 600 s'."""
        within = f" in the last {self._window_s:g} s" if self._window_s is not None else ""
        return f"{len(self._tries)} restarts tried{within}, cluster.max_restarts"

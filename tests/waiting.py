"""Waiting for conditions that depend on timers, threads or other processes."""

import time
from collections.abc import Callable


def wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll `condition` until it holds; fail after `timeout_s`. For effects of timers, other
    threads or processes (lease expiry, a killed actor), not as a substitute for synchronisation."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)

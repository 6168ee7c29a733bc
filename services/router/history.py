"""RequestHistory: the shape and latency of the router's recently finished requests, which the
planner forecasts from (arrival rate, and the distributions of prompt, cached and output
lengths) and checks its predictions against."""

import statistics
import threading
from collections import deque
from dataclasses import dataclass

from pdserve.engine.perf_model import midpoint_quantiles

MESSAGES = 256  # the recent requests whose message times are summarized
QUANTILES = 20  # message time quantiles exported


@dataclass(frozen=True, slots=True)
class Sample:
    arrival: float  # time.perf_counter() when the router received it
    prompt_tokens: int
    cached_tokens: int  # of the prompt, found in a prefix cache where it was computed
    output_tokens: int
    ttft_s: float | None  # None: no token came
    tpot_s: float | None  # mean time per output token after the first; None: fewer than two
    finished: float = 0.0  # time.perf_counter() when it ended
    # one message between the router and an instance, one way, measured on its Prefill call
    # (None: it had none)
    message_s: float | None = None


class RequestHistory:
    """The arrival times of the last `capacity` requests (served, failed or still running:
    the load offered, which a saturated cluster's completions understate) and the last
    `capacity` served ones' samples (oldest dropped first). Thread-safe: the router's event
    loop adds, the planner reads."""

    def __init__(self, capacity: int = 20_000) -> None:
        self._arrivals: deque[float] = deque(maxlen=capacity)
        self._samples: deque[Sample] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def arrived(self, at: float) -> None:
        with self._lock:
            self._arrivals.append(at)

    def add(self, sample: Sample) -> None:
        with self._lock:
            self._samples.append(sample)

    def arrivals_since(self, at: float) -> list[float]:
        """When requests arrived at or after `at` (perf_counter)."""
        with self._lock:
            return [a for a in self._arrivals if a >= at]

    def served_since(self, at: float, at_least: int = 0) -> list[Sample]:
        """The requests served whole that ended at or after `at` (perf_counter) — or the last
        `at_least` served if fewer did —, oldest first (by when they ended: under a heavy load
        a request ends long after it came)."""
        with self._lock:
            recent = [s for s in self._samples if s.finished >= at]
            if len(recent) >= at_least:
                return recent
            return list(self._samples)[len(self._samples) - at_least :]

    def message_s(self) -> float | None:
        """The median time of one message between the router and an instance, one way, over
        the last MESSAGES requests that measured it (None: none did yet)."""
        measured = self._messages()
        return statistics.median(measured) if measured else None

    def message_quantiles(self) -> list[float]:
        """Those times at the midpoints of QUANTILES equal shares, ascending (empty while
        fewer were measured): the spread the latency simulator draws messages from."""
        return midpoint_quantiles(self._messages(), QUANTILES)

    def _messages(self) -> list[float]:
        with self._lock:
            measured: list[float] = []
            for sample in reversed(self._samples):
                if sample.message_s is not None:
                    measured.append(sample.message_s)
                    if len(measured) == MESSAGES:
                        break
        return measured

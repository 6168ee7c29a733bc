"""The SLA planner's decisions: what the next interval's load will be, and which prefill/decode
split serves it within the latency targets with the fewest instances.

Pure logic on an injected clock and an injected `evaluate(split, forecast) -> Prediction` (the
latency simulator in production, a fake in tests); `services/planner/loop.py` feeds it the
cluster's state and carries its decisions out.

Why it does not oscillate (each rule is a test with a fake clock):
- a band, not a line: the current split is kept while its predicted p90s are within the targets
  at the forecast load; a split moved to must meet them at `headroom` more load than forecast,
  so a load that wanders near a target does not toggle between two splits;
- the same change must be chosen `confirm_intervals` times in a row before it is made;
- after any change, `cooldown_s` of watching only; and none while an instance is not ready
  (added or restarted instances that have not stepped yet would make the load look lighter or
  heavier than it is);
- when no split can meet the targets, the best one is held (it says so) and a move needs a
  clear goodput gain (`UNREACHABLE_GAIN`), never a coin toss between two failing splits.
"""

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from pdserve.config import PlannerConfig
from services.router.history import Sample

UNREACHABLE_GAIN = 0.05  # goodput (fraction of requests) a move must win when no split meets
LENGTHS_AT_LEAST = 32  # requests the lengths are drawn from when none ended in the history


@dataclass(frozen=True, slots=True, order=True)
class Split:
    prefill: int
    decode: int

    @property
    def total(self) -> int:
        return self.prefill + self.decode

    def moves_from(self, other: "Split") -> int:
        """Instances that change (role or existence) going from `other` to this split."""
        return max(abs(self.prefill - other.prefill), abs(self.decode - other.decode))

    def __str__(self) -> str:
        return f"{self.prefill}P{self.decode}D"


@dataclass(frozen=True, slots=True)
class Forecast:
    """The next interval's load: its arrival rate and requests drawn from `samples` (the
    recent ones' prompt, cached and output lengths: the distribution, not its mean)."""

    rate_per_s: float
    samples: tuple[Sample, ...]


@dataclass(frozen=True, slots=True)
class Prediction:
    ttft_p90_s: float
    itl_p90_s: float
    goodput: float  # fraction of requests within both targets


@dataclass(frozen=True, slots=True)
class Decision:
    at: float  # the planner's clock
    action: str  # hold | wait | change (roles and/or instances)
    current: Split
    target: Split
    reason: str
    # the target's: at the forecast when it is the current split, else at `headroom` more
    predicted: Prediction | None = None
    observed: Prediction | None = None  # the last interval's requests
    unreachable: bool = False  # no split meets the targets
    predictions: dict[Split, Prediction] = field(default_factory=dict)  # at `headroom` more
    load: Forecast | None = None  # what was forecast (None: nothing to)


def forecast(
    arrivals: Sequence[float], samples: Sequence[Sample], now: float, config: PlannerConfig
) -> Forecast | None:
    """The next interval's load at `now` (perf_counter): the arrival rate of the last
    `interval_s` (every request that came, served or not: a saturated cluster serves less than
    is asked of it), raised by half its rise over the interval before (a rising load is met
    before it arrives, without doubling the noise of a steady one; a falling one is believed
    once seen; an idle interval forecasts none: the planner may shrink), and the lengths of
    the requests that ended in the last `history_s` — or, when none did (requests that take
    longer than the history: an overloaded cluster's), of the last `LENGTHS_AT_LEAST` served.
    `samples`: in the order they ended, at least those. None before any request was served."""
    interval = config.interval_s
    last = sum(1 for a in arrivals if a >= now - interval)
    before = sum(1 for a in arrivals if now - 2 * interval <= a < now - interval)
    if not samples:
        return None
    rate = (last + max(0, last - before) / 2) / interval
    recent = tuple(s for s in samples if s.finished >= now - config.history_s)
    return Forecast(rate, recent or tuple(samples[-LENGTHS_AT_LEAST:]))


def observed(samples: Sequence[Sample], now: float, config: PlannerConfig) -> Prediction | None:
    """The p90 TTFT and per-token time of the requests that ended in the last interval, and the
    fraction within both targets (None without one)."""
    window = [s for s in samples if s.finished >= now - config.interval_s and s.ttft_s is not None]
    if not window:
        return None
    ttfts = sorted(s.ttft_s or 0.0 for s in window)
    itls = sorted(s.tpot_s for s in window if s.tpot_s is not None)
    good = sum(
        1
        for s in window
        if (s.ttft_s or 0.0) <= config.ttft_p90_s and (s.tpot_s or 0.0) <= config.itl_p90_s
    )
    return Prediction(p90(ttfts), p90(itls) if itls else 0.0, good / len(window))


def p90(values: Sequence[float]) -> float:
    """The nearest-rank 90th percentile of sorted `values`."""
    return values[max(0, math.ceil(0.9 * len(values)) - 1)]


class Planner:
    """Not thread-safe: the planner loop's thread owns it (`decisions` is read elsewhere as a
    snapshot: `recent`)."""

    def __init__(
        self,
        config: PlannerConfig,
        evaluate: Callable[[Split, Forecast], Prediction],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._evaluate = evaluate
        self._clock = clock
        self._acted_at = -math.inf
        self._streak: tuple[Split, int] | None = None  # a change chosen, how many times in a row
        self.decisions: deque[Decision] = deque(maxlen=64)

    def set_targets(self, ttft_p90_s: float, itl_p90_s: float) -> None:
        """New latency targets from the next decision on. Raises ConfigError."""
        self.config = replace(self.config, ttft_p90_s=ttft_p90_s, itl_p90_s=itl_p90_s)
        self._streak = None

    def recent(self) -> list[Decision]:
        """The last decisions, newest last."""
        return list(self.decisions)

    def candidates(self, current: Split) -> list[Split]:
        """Splits within the configured bounds of one instance more, as many, or one fewer
        than now (a bigger jump is made over several intervals)."""
        c = self.config
        return [
            Split(p, d)
            for p in range(c.min_prefill, c.max_prefill + 1)
            for d in range(c.min_decode, c.max_decode + 1)
            if c.min_instances <= p + d <= c.max_instances and abs(p + d - current.total) <= 1
        ]

    def decide(
        self,
        current: Split,
        load: Forecast | None,
        seen: Prediction | None = None,
        not_ready: Sequence[str] = (),
    ) -> Decision:
        """This interval's decision (also kept in `decisions`). `not_ready`: instances that
        have not served yet (the planner waits for them)."""
        now = self._clock()
        decision = self._decide(now, current, load, seen, not_ready)
        if decision.action == "change":
            self._acted_at, self._streak = now, None
        self.decisions.append(decision)
        return decision

    def _decide(
        self,
        now: float,
        current: Split,
        load: Forecast | None,
        seen: Prediction | None,
        not_ready: Sequence[str],
    ) -> Decision:
        def hold(
            action: str,
            reason: str,
            predicted: Prediction | None = None,
            unreachable: bool = False,
            predictions: dict[Split, Prediction] | None = None,
        ) -> Decision:
            return Decision(now, action, current, current, reason, predicted, seen, unreachable,
                            predictions or {}, load)  # fmt: skip

        if not_ready:
            return hold("wait", f"waiting for {', '.join(not_ready)} to serve")
        if now - self._acted_at < self.config.cooldown_s:
            return hold("wait", "cooling down after the last change")
        if load is None:
            self._streak = None
            return hold("hold", "nothing to forecast: no request served yet")
        heavier = Forecast(load.rate_per_s * (1.0 + self.config.headroom), load.samples)
        predictions = {split: self._evaluate(split, heavier) for split in self.candidates(current)}
        as_is = self._evaluate(current, load)
        target, reason, unreachable = self._choose(current, as_is, predictions)
        if target == current:
            self._streak = None
            return hold("hold", reason, predicted=as_is, unreachable=unreachable,
                        predictions=predictions)  # fmt: skip
        predicted = predictions[target]
        count = self._streak[1] + 1 if self._streak and self._streak[0] == target else 1
        self._streak = (target, count)
        if count < self.config.confirm_intervals:
            return hold(
                "hold",
                f"{reason}; chosen {count} of {self.config.confirm_intervals} times",
                predicted=predicted, unreachable=unreachable, predictions=predictions,
            )  # fmt: skip
        return Decision(now, "change", current, target, reason, predicted, seen, unreachable,
                        predictions, load)  # fmt: skip

    def _choose(
        self, current: Split, now: Prediction, predictions: dict[Split, Prediction]
    ) -> tuple[Split, str, bool]:
        """(target, why, no split meets the targets). `now`: the current split at the forecast
        load; `predictions`: every candidate at `headroom` more."""
        strict = [s for s, p in predictions.items() if self._meets(p)]

        def best(splits: list[Split]) -> Split:
            return min(splits, key=lambda s: (s.total, -predictions[s].goodput,
                                              s.moves_from(current), s))  # fmt: skip

        # a split predicted to meet the targets at more load meets them at the forecast (its
        # miss there is the two traces' noise)
        if self._meets(now) or current in strict:
            fewer = [s for s in strict if s.total < current.total]
            if fewer:
                target = best(fewer)
                return target, f"{target} meets the targets with fewer instances", False
            return current, f"{current} meets the targets", False
        if strict:
            target = best(strict)
            return target, f"{current} misses the targets, {target} meets them", False
        target = max(predictions, key=lambda s: (predictions[s].goodput, -s.moves_from(current)))
        gain = predictions[target].goodput - predictions.get(current, now).goodput
        if target != current and gain >= UNREACHABLE_GAIN:
            return target, f"no split meets the targets; {target} serves the most within them", True
        return current, "no split meets the targets; holding the best one", True

    def _meets(self, prediction: Prediction) -> bool:
        c = self.config
        return prediction.ttft_p90_s <= c.ttft_p90_s and prediction.itl_p90_s <= c.itl_p90_s


def plan(
    planner: Planner,
    current: Split,
    history: tuple[Sequence[float], Sequence[Sample]],
    now: float,
    not_ready: Sequence[str],
    prepare: Callable[[], object],
) -> tuple[Decision, Forecast | None]:
    """One planning interval: the forecast from `history` (arrival times, samples of the
    requests served; `now` on their clock), `prepare()` readying this interval's model
    (skipped without a forecast or while instances are not ready), and the decision."""
    arrivals, samples = history
    load = forecast(arrivals, samples, now, planner.config)
    if load is not None and not not_ready:
        prepare()
    seen = observed(samples, now, planner.config)
    return planner.decide(current, load, seen, not_ready), load


def steps(current: Split, target: Split) -> list[tuple[str, str]]:
    """How to go from `current` to `target`, role changes first (seconds, no new resources):
    ("role", "decode") moves an instance to decode, ("add", role) starts one, ("remove", role)
    retires one."""
    moves: list[tuple[str, str]] = []
    prefill, decode = current.prefill, current.decode
    while prefill < target.prefill and decode > target.decode:
        moves.append(("role", "prefill"))
        prefill, decode = prefill + 1, decode - 1
    while decode < target.decode and prefill > target.prefill:
        moves.append(("role", "decode"))
        prefill, decode = prefill - 1, decode + 1
    moves += [("add", "prefill")] * max(0, target.prefill - prefill)
    moves += [("add", "decode")] * max(0, target.decode - decode)
    moves += [("remove", "prefill")] * max(0, prefill - target.prefill)
    moves += [("remove", "decode")] * max(0, decode - target.decode)
    return moves

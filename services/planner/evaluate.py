"""How the planner predicts a split's latency: the latency simulator (the real scheduler, KV
cache, router and transfer model on the instances' own step time fits) replays a synthetic
trace of the forecast load.

The trace: Poisson arrivals at the forecast rate; each request's prompt, cached and output
lengths drawn together from one recent request (so their distributions and correlations are
kept, not averaged). A request's cached tokens are a prefix shared by every request of the
trace (hash ids 0, 1, ...), the rest is its own: the simulated prefix caches then find about
what the live ones found. Every split replays the same trace (common random numbers: the
comparison is not noise).

The simulated cluster starts empty, the live one does not: a decode instance holds every
request of the last lifetime or so (at 20 requests/s of 10 s each, 200 at once). So the trace
starts with a warm-up as long as recent requests lived (`warm_up_s`) and only the requests that
arrive after it are judged; judged from the start, a split would look as fast as an idle one
and the planner would keep a split whose decode instances are long past their target.
"""

import math
import random
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from pdserve.config import ClusterConfig
from pdserve.errors import ConfigError
from services.planner.planner import Forecast, Prediction, Split
from services.router.history import Sample
from services.simulator.latency import InstanceProfile, Simulation
from services.simulator.latency_report import summarize
from services.simulator.profiles import cluster_spec
from services.simulator.trace import TraceRecord

MAX_REQUESTS = 500  # per simulated split: ~1-2 s on one core
UNIQUE_IDS = 1 << 40  # the first hash id of requests' own blocks


@dataclass(frozen=True, slots=True)
class SimulatedCluster:
    """What every evaluation of one planning interval shares."""

    config: ClusterConfig
    profiles: Mapping[str, InstanceProfile]  # by role, from the live instances
    transfer_gbps: float | None  # measured; None: `router.kv_transfer_gbps`
    vocab_size: int
    rpc_s: float = 0.0  # one message between processes, one way (the router's measured)
    rpc_draws_s: tuple[float, ...] = ()  # its measured quantiles, each message draws from


def synthetic_trace(
    load: Forecast, duration_s: float, block_tokens: int, seed: int = 0
) -> list[TraceRecord]:
    """`load` for `duration_s` (at most MAX_REQUESTS requests), as trace records."""
    rng = random.Random(seed)
    count = max(1, min(MAX_REQUESTS, round(load.rate_per_s * duration_s)))
    records, at, unique = [], 0.0, UNIQUE_IDS
    for _ in range(count):
        at += rng.expovariate(load.rate_per_s)
        sample = rng.choice(load.samples)
        shared = min(sample.cached_tokens, sample.prompt_tokens) // block_tokens
        blocks = math.ceil(sample.prompt_tokens / block_tokens)
        own = range(unique, unique + blocks - shared)
        unique += len(own)
        hash_ids = (*range(shared), *own)
        records.append(TraceRecord(1000 * at, sample.prompt_tokens, max(1, sample.output_tokens),
                                   hash_ids))  # fmt: skip
    return records


def warm_up_s(load: Forecast, interval_s: float) -> float:
    """How long the simulated cluster runs before its requests are judged: the p90 of how
    long the recent requests lived (arrival to last token), at most three intervals, and
    shortened to keep a warm-up and an interval within MAX_REQUESTS."""
    lives = sorted(s.finished - s.arrival for s in load.samples)
    warm = min(lives[int(0.9 * (len(lives) - 1))], 3 * interval_s)
    return max(0.0, min(warm, MAX_REQUESTS / load.rate_per_s - interval_s))


SIZINGS = ("distribution", "mean")


class IntervalModel:
    """One planning interval's model, `predict(split, load)`: each load's trace made once
    (the current split is judged at the forecast, the candidates at `headroom` more) and
    replayed for every split. `sizing="mean"` makes every request of the trace the recent
    mean (the planner most autoscalers run: NVIDIA Dynamo's sizes from the mean input and
    output length) instead of drawing lengths from their distribution."""

    def __init__(
        self, cluster: SimulatedCluster, interval_s: float, sizing: str = "distribution"
    ) -> None:
        if sizing not in SIZINGS:
            raise ConfigError(f"planner sizing must be one of {', '.join(SIZINGS)}, not {sizing!r}")
        self.cluster = cluster
        self.interval_s = interval_s
        self.sizing = sizing
        self._traces: dict[float, tuple[list[TraceRecord], float]] = {}  # by arrival rate

    def predict(self, split: Split, load: Forecast) -> Prediction:
        if load.rate_per_s == 0:
            return Prediction(0.0, 0.0, 1.0)  # nothing arrives: nothing is late
        made = self._traces.get(load.rate_per_s)
        if made is None:
            warm = warm_up_s(load, self.interval_s)
            if self.sizing == "mean":
                load = means(load)
            block_tokens = self.cluster.profiles["prefill"].block_size
            trace = synthetic_trace(load, warm + self.interval_s, block_tokens)
            made = self._traces[load.rate_per_s] = (trace, warm)
        return predict(self.cluster, split, *made)


def means(load: Forecast) -> Forecast:
    """`load` with every request of the recent mean prompt, cached and output lengths."""
    samples = load.samples

    def mean(length: Callable[[Sample], int]) -> int:
        return round(statistics.fmean(length(s) for s in samples))

    typical = Sample(0.0, mean(lambda s: s.prompt_tokens), mean(lambda s: s.cached_tokens),
                     mean(lambda s: s.output_tokens), None, None)  # fmt: skip
    return Forecast(load.rate_per_s, (typical,))


def predict(
    cluster: SimulatedCluster, split: Split, records: list[TraceRecord], judged_from_s: float = 0.0
) -> Prediction:
    """The split's p90 TTFT and per-token time, and goodput, replaying `records` (of the
    requests that arrive `judged_from_s` or later in the trace's time)."""
    config = cluster.config
    counts = {"prefill": split.prefill, "decode": split.decode}
    spec = cluster_spec(config, cluster.profiles, counts, cluster.transfer_gbps,
                        cluster.vocab_size, cluster.rpc_s, cluster.rpc_draws_s)  # fmt: skip
    block_tokens = cluster.profiles["prefill"].block_size
    result = Simulation(spec, block_tokens).run(records)
    judged = [r for r in result.requests if r.arrival >= judged_from_s]
    result = replace(result, requests=judged or result.requests)
    planner = config.planner
    figures = summarize(result, planner.ttft_p90_s, planner.itl_p90_s)
    ttft, tpot = figures["ttft_s"]["p90"], figures["tpot_s"]["p90"]
    return Prediction(
        math.inf if math.isnan(ttft) else ttft,  # nothing served
        0.0 if math.isnan(tpot) else tpot,  # single-token answers only
        float(figures["goodput"]),
    )

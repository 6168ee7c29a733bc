"""How the planner predicts a split's latency: the latency simulator (the real scheduler, KV
cache, router and transfer model on the instances' own step time fits) replays a synthetic
trace of the forecast load.

The trace: Poisson arrivals at the forecast rate; each request's prompt, cached and output
lengths drawn together from one recent request (so their distributions and correlations are
kept, not averaged). A request's cached tokens are a prefix shared by every request of the
trace (hash ids 0, 1, ...), the rest is its own: the simulated prefix caches then find about
what the live ones found. Every split replays the same trace (common random numbers: the
comparison is not noise).
"""

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

from pdserve.config import ClusterConfig
from services.planner.planner import Forecast, Prediction, Split
from services.simulator.latency import InstanceProfile, Simulation
from services.simulator.latency_report import summarize
from services.simulator.profiles import cluster_spec
from services.simulator.trace import TraceRecord

MAX_REQUESTS = 200  # per simulated split: ~0.3-1 s on one core
UNIQUE_IDS = 1 << 40  # the first hash id of requests' own blocks


@dataclass(frozen=True, slots=True)
class SimulatedCluster:
    """What every evaluation of one planning interval shares."""

    config: ClusterConfig
    profiles: Mapping[str, InstanceProfile]  # by role, from the live instances
    transfer_gbps: float | None  # measured; None: `router.kv_transfer_gbps`
    vocab_size: int


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


def predict(cluster: SimulatedCluster, split: Split, records: list[TraceRecord]) -> Prediction:
    """The split's p90 TTFT and per-token time, and goodput, replaying `records`."""
    config = cluster.config
    counts = {"prefill": split.prefill, "decode": split.decode}
    spec = cluster_spec(config, cluster.profiles, counts, cluster.transfer_gbps, cluster.vocab_size)
    block_tokens = cluster.profiles["prefill"].block_size
    result = Simulation(spec, block_tokens).run(records)
    planner = config.planner
    figures = summarize(result, planner.ttft_p90_s, planner.itl_p90_s)
    ttft, tpot = figures["ttft_s"]["p90"], figures["tpot_s"]["p90"]
    return Prediction(
        math.inf if math.isnan(ttft) else ttft,  # nothing served
        0.0 if math.isnan(tpot) else tpot,  # single-token answers only
        float(figures["goodput"]),
    )

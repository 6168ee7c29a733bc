"""Eviction policies on replayed traces: hit rate of `lru` and `lrfu` at three device cache
sizes, against Belady's offline optimum.

    python benchmarks/cache_policy.py [--quick] [--half-life-s 60]

Workloads (all in the public trace format, 512-token blocks):
  * `conversations` — generated here (`services.simulator.trace.conversations`, 12,000 requests;
    quick 4,000): multi-turn chat sessions arriving as a Poisson process (120 per minute), each on
    one of 8 shared system prompts (Zipf-popular), a third with one of 400 long documents (4-24
    blocks, Zipf), 1-12 turns with exponential think times (mean 30 s); every turn resends the
    whole conversation.
  * `documents` — generated: questions over 1,000 shared documents (Zipf), 4 requests/s.
  * `sample_trace`, `documents_trace` — the committed small traces (benchmarks/workloads/).
Each is replayed through the real `KVCacheManager` with one instance and no storage tier
(`pdserve simulate`'s replay); the three capacities are 1/64, 1/16 and 1/4 of the trace's distinct
blocks, where a cache is under pressure. Belady evicts the block used farthest in the future
(ties deepest first) in one cache of the same size.

RESULT: `lrfu_vs_lru` (geometric mean of the hit-rate ratios over every workload and capacity),
`lrfu_vs_lru_min`, `lru_vs_belady`, `lrfu_vs_belady` (geometric means).
"""

import argparse
import math
from pathlib import Path

from _common import finish, parse_args, print_table

from services.simulator.optimum import belady
from services.simulator.replay import SimConfig, Simulation
from services.simulator.trace import TraceRecord, conversations, documents, load_trace

NAME = "cache_policy"
WORKLOADS_DIR = Path(__file__).resolve().parent / "workloads"
FRACTIONS = (1 / 64, 1 / 16, 1 / 4)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--half-life-s", type=float, default=60.0, help="lrfu half-life (60)")
    parser.add_argument("--seed", type=int, default=0)


def workloads(quick: bool, seed: int) -> dict[str, list[TraceRecord]]:
    count = 4_000 if quick else 12_000
    return {
        "conversations": conversations(count, seed=seed),
        "documents": documents(count, seed=seed),
        "sample_trace": load_trace(WORKLOADS_DIR / "sample_trace.jsonl"),
        "documents_trace": load_trace(WORKLOADS_DIR / "documents_trace.jsonl"),
    }


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    rows, results = [], []
    for name, records in workloads(args.quick, args.seed).items():
        distinct = len({h for r in records for h in r.hash_ids})
        for fraction in FRACTIONS:
            capacity = max(4, int(distinct * fraction))
            rates = {
                policy: Simulation(
                    SimConfig(capacity, eviction=policy, half_life_s=args.half_life_s)
                )
                .run(records)
                .cluster.rates()["total"]
                for policy in ("lru", "lrfu")
            }
            optimum = belady(records, 512, capacity).rates()["total"]
            result = {"workload": name, "capacity": capacity, **rates, "belady": optimum}
            results.append(result)
            rows.append([name, capacity, rates["lru"], rates["lrfu"], optimum,
                         _ratio(rates["lru"], optimum), _ratio(rates["lrfu"], optimum),
                         _ratio(rates["lrfu"], rates["lru"])])  # fmt: skip
    print_table(
        f"hit rate (blocks), one instance, lrfu half-life {args.half_life_s:g} s",
        ["workload", "blocks", "lru", "lrfu", "belady", "lru/bel", "lrfu/bel", "lrfu/lru"],
        rows,
    )
    gains = [_ratio(r["lrfu"], r["lru"]) for r in results]
    metrics = {
        "lrfu_vs_lru": _geomean(gains),
        "lrfu_vs_lru_min": min(gains),
        "lru_vs_belady": _geomean([_ratio(r["lru"], r["belady"]) for r in results]),
        "lrfu_vs_belady": _geomean([_ratio(r["lrfu"], r["belady"]) for r in results]),
    }
    finish(NAME, args, {"rows": results}, metrics)


def _ratio(a: float, b: float) -> float:
    return a / b if b else 1.0


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(max(v, 1e-9)) for v in values) / len(values))


if __name__ == "__main__":
    main()

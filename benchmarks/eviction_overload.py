"""Eviction policies under overload: `lrfu` against `lru` when requests queue for long.

    python benchmarks/eviction_overload.py [--quick]

The committed documents trace (`benchmarks/workloads/documents_trace.jsonl`, 64-token blocks:
every prompt scaled by 64/512, answers of at most 256 tokens, as `serve_load --trace ...
--block-tokens 64` sends it) through the latency simulator (`pdserve simulate --latency`: the
real scheduler, prompt admission, KV cache manager and router on simulated time, the `tiny-cpu`
step model): 2 prefill + 1 decode instances with each policy, at the trace's own rate (time
scale 1) and at 10, 50 and 100 times it (0.1, 0.02, 0.01: requests wait seconds for their
prefill), with 128, 256 and 512 blocks of 16 tokens per prefill instance (the trace's prompts
fit in about 512). Deterministic: a run is the same every time, so a policy change shows
without repeats. The hit rate is the prefill instances' device hits over their prompt tokens.
`--quick`: time scales 1 and 0.02 only.

RESULT: `lrfu_vs_lru` (geometric mean of the hit-rate ratios over every row),
`lrfu_vs_lru_overloaded` (over the rows with a time scale below 0.1), `lrfu_vs_lru_min`.
"""

import argparse
import dataclasses
import math
from pathlib import Path

from _common import finish, parse_args, print_table

from pdserve.config import ClusterConfig
from services.simulator.latency import ClusterSpec, Simulation
from services.simulator.profiles import cluster_spec, from_config, step_model
from services.simulator.trace import TraceRecord, load_trace

NAME = "eviction_overload"
TRACE = Path(__file__).resolve().parent / "workloads" / "documents_trace.jsonl"
BLOCK_TOKENS = 64  # tokens per hash id, as serve_load replays the trace for the tiny model
SCALES = (1.0, 0.1, 0.02, 0.01)
QUICK_SCALES = (1.0, 0.02)
BLOCKS = (128, 256, 512)
VOCAB_SIZE = 262  # the tiny model's


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0)


def records(scale: float) -> list[TraceRecord]:
    """The trace with prompts scaled to 64-token blocks and timestamps x `scale`."""
    trace = load_trace(TRACE)
    start = trace[0].timestamp_ms
    return [
        dataclasses.replace(
            r,
            timestamp_ms=start + (r.timestamp_ms - start) * scale,
            input_length=max(1, r.input_length * BLOCK_TOKENS // 512),
            output_length=min(r.output_length, 256),
        )
        for r in trace
    ]


def spec(policy: str, blocks: int) -> ClusterSpec:
    config = ClusterConfig()
    profiles = from_config(config, step_model("tiny-cpu"), blocks)
    profiles = {
        role: dataclasses.replace(p, eviction_policy=policy) for role, p in profiles.items()
    }
    return cluster_spec(config, profiles, {"prefill": 2, "decode": 1, "mixed": 0}, None, VOCAB_SIZE)


def hit_rate(policy: str, scale: float, blocks: int, seed: int) -> float:
    simulation = Simulation(spec(policy, blocks), BLOCK_TOKENS, seed)
    simulation.run(records(scale), lambda: None)
    prefill = [i for i in simulation.instances.values() if i.role == "prefill"]
    queries = sum(i.scheduler.stats.prefix_cache_queries for i in prefill)
    hits = sum(i.scheduler.stats.device_hit_tokens for i in prefill)
    return hits / queries if queries else math.nan


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    rows, results = [], []
    for scale in QUICK_SCALES if args.quick else SCALES:
        for blocks in BLOCKS:
            lru = hit_rate("lru", scale, blocks, args.seed)
            lrfu = hit_rate("lrfu", scale, blocks, args.seed)
            results.append({"time_scale": scale, "blocks": blocks, "lru": lru, "lrfu": lrfu,
                            "lrfu_vs_lru": lrfu / lru})  # fmt: skip
            rows.append([f"{scale:g}", blocks, lru, lrfu, lrfu / lru])
            print(f"time scale {scale:g}, {blocks} blocks: lrfu / lru {lrfu / lru:.3f}", flush=True)
    print_table("prefill hit rate", ["time scale", "blocks", "lru", "lrfu", "lrfu / lru"], rows)

    def geomean(values: list[float]) -> float:
        return math.exp(sum(math.log(v) for v in values) / len(values))

    ratios = [r["lrfu_vs_lru"] for r in results]
    overloaded = [r["lrfu_vs_lru"] for r in results if r["time_scale"] < 0.1]
    metrics = {
        "lrfu_vs_lru": geomean(ratios),
        "lrfu_vs_lru_overloaded": geomean(overloaded),
        "lrfu_vs_lru_min": min(ratios),
    }
    finish(NAME, args, {"rows": results}, metrics)


if __name__ == "__main__":
    main()

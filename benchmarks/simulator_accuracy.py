"""The latency simulator against a live run of the same trace.

    python benchmarks/simulator_accuracy.py [--quick]

The trace: the built-in `documents` workload (questions over Zipf-popular shared documents)
with `--block-tokens` 32 per hash id (prompts of ~130–960 tokens, answers of 16–256), arrivals
at `--rate` requests/s (3: what two cores hold with room) for `--seconds` (60; quick 20).

Live: `pdserve up` (its own local Ray; one prefill and one decode instance on the built-in tiny
model, one torch thread each, 2,048 KV blocks, no storage tier: the simulator has none) replays
it open-loop: each record becomes a streamed `/v1/completions` of its prompt's token ids
(each hash id's tokens drawn from a generator seeded by the id, as the simulator draws them),
greedy, `ignore_eos`, `max_tokens` its output length, sent at its timestamp. TTFT: sent ->
first token at the client; ITL: the gaps between a request's streamed chunks (one per engine
step).

Simulated: the same records through `pdserve simulate --latency`'s simulation, its instances
taken from the live cluster after the replay (`pdserve admin list --json`: each role's step
time fit, engine-loop gap per step and KV pool, and the router's measured time of one message
between processes: half a Prefill call's round trip less prefill's own time, the median over
the recent requests, each simulated message drawing its time from their quantiles), its link
speed from prefill's measured KV transfers.

Reported: TTFT and ITL p50/p90 live and simulated, each ratio simulated ÷ live. Target (issue's
acceptance): p50 within 15 %, p90 within 25 %. Writes benchmarks/results/simulator_accuracy.json,
ends with one RESULT line.
"""

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from _common import finish, parse_args, print_table
from _online import PdserveCluster

from pdserve.config import load_cluster_config
from pdserve.model.tiny import default_model_dir
from services.simulator.latency import Simulation, TokenSource
from services.simulator.latency_report import percentiles, summarize
from services.simulator.profiles import (
    cluster_spec,
    from_instances,
    measured_link_gbps,
    measured_messages,
)
from services.simulator.trace import TraceRecord, documents

NAME = "simulator_accuracy"
ROOT = Path(__file__).resolve().parent.parent
VOCAB = 262  # the tiny model's
CONFIG: dict[str, Any] = {
    "engine": {"model": str(default_model_dir()), "torch_threads": 1, "num_kv_blocks": 2048},
    "prefill": {"num_cpus": 0.5},
    "decode": {"num_cpus": 0.5},
    "router": {"stats_interval_s": 0.2, "model_name": "tiny"},
    "storage": {"enabled": False},  # the simulator does not model the storage tier
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=None, help="trace length (60; 20)")
    parser.add_argument("--rate", type=float, default=3.0, help="requests/s")
    parser.add_argument("--block-tokens", type=int, default=32, help="tokens per hash id")
    parser.add_argument("--seed", type=int, default=0)


def trace(args: argparse.Namespace, seconds: float) -> list[TraceRecord]:
    records = documents(10_000, seed=args.seed, block_tokens=args.block_tokens,
                        rate_per_s=args.rate)  # fmt: skip
    return [r for r in records if r.timestamp_ms < seconds * 1000]


async def replay(url: str, records: list[TraceRecord], tokens: TokenSource) -> list[dict[str, Any]]:
    """Each record sent at its time; per request, in the records' order: TTFT and the gaps
    between its chunks."""
    endpoint = f"{url.removesuffix('/v1')}/v1/completions"
    results: list[dict[str, Any]] = [{} for _ in records]
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(index: int, record: TraceRecord) -> None:
            body = {"model": "tiny", "prompt": tokens.prompt(record), "temperature": 0,
                    "max_tokens": record.output_length, "ignore_eos": True,
                    "stream": True}  # fmt: skip
            sent = time.perf_counter()
            arrivals: list[float] = []
            async with client.stream("POST", endpoint, json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"{response.status_code}: {await response.aread()!r}")
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and '"text"' in line:
                        arrivals.append(time.perf_counter())
            gaps = [b - a for a, b in itertools.pairwise(arrivals)]
            results[index] = {"ttft": arrivals[0] - sent, "gaps": gaps, "chunks": len(arrivals)}

        start = time.perf_counter()
        base = records[0].timestamp_ms / 1000
        tasks = []
        for index, record in enumerate(records):
            delay = start + record.timestamp_ms / 1000 - base - time.perf_counter()
            await asyncio.sleep(max(0.0, delay))
            tasks.append(asyncio.ensure_future(one(index, record)))
        await asyncio.gather(*tasks)
    return results


def live_instances(cluster: PdserveCluster, path: Path) -> None:
    """`pdserve admin list --json` of the running cluster, into `path`."""
    argv = [sys.executable, "-m", "services.controller.cli", "admin", "list", "--json",
            "--state-dir", str(cluster.state_dir)]  # fmt: skip
    path.write_text(
        subprocess.run(argv, check=True, capture_output=True, text=True, cwd=ROOT).stdout
    )


def stage_means(url: str, instances: dict[str, Any]) -> dict[str, float]:
    """Mean seconds of each stage histogram the router and the instances export (where a
    request's live time went, next to what the simulator models)."""
    endpoints = {"router": url.removesuffix("/v1") + "/metrics"}
    for instance in instances["instances"]:
        endpoints[instance["role"]] = f"http://{instance['metrics_address']}/metrics"
    means: dict[str, float] = {}
    for who, endpoint in endpoints.items():
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}
        for line in httpx.get(endpoint, timeout=10).text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.endswith("_seconds_sum") or "_seconds_sum{" in name:
                sums[name.replace("_sum", "", 1)] = float(value)
            elif name.endswith("_seconds_count") or "_seconds_count{" in name:
                counts[name.replace("_count", "", 1)] = float(value)
        for name, total in sums.items():
            if counts.get(name):
                means[f"{who} {name}"] = total / counts[name]
    return means


def stage_means_simulated(result: Any) -> dict[str, float]:
    """Mean seconds between the points a simulated disaggregated request passed, named as the
    live stages they stand for."""
    spans = {
        "arrival -> at prefill (the router's hop)": ("arrival", "at_prefill"),
        "reservation wait (prefill)": ("at_prefill", "reserved"),
        "queue + prefill (prefill)": ("reserved", "computed"),
        "computed -> handed off (transfer, hops, decode's mailbox)": ("computed", "handed_off"),
        "handed off -> first token at the client": ("handed_off", "first_token"),
        "TTFT": ("arrival", "first_token"),
    }
    means = {}
    remote = [r for r in result.requests if r.path == "remote" and r.first_token is not None]
    for name, (start, end) in spans.items():
        points = [{**r.marks, "arrival": r.arrival, "first_token": r.first_token} for r in remote]
        gaps = [p[end] - p[start] for p in points if start in p and end in p]
        if gaps:
            means[name] = statistics.fmean(gaps)
    return means


def link_gbps(instances: Path) -> float:
    """Prefill's measured KV transfer speed (GB/s)."""
    gbps = measured_link_gbps(json.loads(instances.read_text())["instances"])
    if gbps is None:
        raise RuntimeError("prefill measured no KV transfer")
    return gbps


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    seconds = args.seconds or (20.0 if args.quick else 60.0)
    records = trace(args, seconds)
    tokens = TokenSource(args.block_tokens, VOCAB, args.seed)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cluster = PdserveCluster("simulator-accuracy", CONFIG, env, start_timeout_s=300, root=ROOT)
    cluster.start()
    instances = cluster.state_dir / "instances.json"
    try:
        live = asyncio.run(replay(cluster.url, records, tokens))
        live_instances(cluster, instances)
        rpc_s, draws = measured_messages(instances)
        gbps = link_gbps(instances)
        saved = json.loads(instances.read_text())
        stages = stage_means(cluster.url, saved)
    finally:
        cluster.stop()
    config = load_cluster_config(None, overrides={"router": CONFIG["router"]})
    profiles, counts = from_instances(instances, config)
    spec = cluster_spec(config, profiles, counts, gbps, VOCAB, rpc_s, draws)
    started = time.perf_counter()
    result = Simulation(spec, args.block_tokens, args.seed).run(records)
    simulate_s = time.perf_counter() - started
    simulated = summarize(result, ttft_slo_s=1.0, itl_slo_s=0.1)
    measured = {
        "ttft_s": percentiles([r["ttft"] for r in live]),
        "itl_s": percentiles([g for r in live for g in r["gaps"]]),
    }
    figures = compare(measured, simulated)
    report(figures, len(records), seconds, gbps, simulate_s)
    print(
        f"one message between processes: median {rpc_s * 1000:.2f} ms, quantiles "
        f"{', '.join(f'{1000 * d:.1f}' for d in draws)} (the router's measured)"
    )
    print("\nlive stage means (ms):")
    for name, mean in sorted(stages.items()):
        print(f"  {name}: {1000 * mean:.2f}")
    simulated_stages = stage_means_simulated(result)
    print("simulated stage means of the disaggregated requests (ms):")
    for name, mean in simulated_stages.items():
        print(f"  {name}: {1000 * mean:.2f}")
    metrics = {f"{what}_{q}_ratio": figures[what][f"{q}_ratio"] for what in ("ttft", "itl")
               for q in ("p50", "p90")}  # fmt: skip
    within = all(abs(metrics[f"{w}_p50_ratio"] - 1) <= 0.15 for w in ("ttft", "itl")) and all(
        abs(metrics[f"{w}_p90_ratio"] - 1) <= 0.25 for w in ("ttft", "itl")
    )
    metrics["within_target"] = float(within)
    metrics["simulate_s"] = simulate_s
    finish(NAME, args, {"figures": figures, "simulated": simulated,
                        "live_ttft_s": [r["ttft"] for r in live],  # in the trace's order
                        "simulated_ttft_s": [r.ttft for r in result.requests],
                        "instances": saved, "link_gbps": gbps, "rpc_s": rpc_s, "rpc_draws_s": draws,
                        "live_stage_means_s": stages,
                        "simulated_stage_means_s": simulated_stages}, metrics)  # fmt: skip


def compare(measured: dict[str, dict[str, float]], simulated: dict[str, Any]) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for what in ("ttft", "itl"):
        entry: dict[str, float] = {}
        for q in ("p50", "p90", "p99"):
            live, sim = measured[f"{what}_s"][q], simulated[f"{what}_s"][q]
            entry[f"live_{q}_ms"], entry[f"sim_{q}_ms"] = 1000 * live, 1000 * sim
            entry[f"{q}_ratio"] = sim / live
        figures[what] = entry
    return figures


def report(
    figures: dict[str, Any], requests: int, seconds: float, gbps: float, sim_s: float
) -> None:
    rows = [
        [what.upper(), f[f"live_{q}_ms"], f[f"sim_{q}_ms"], f[f"{q}_ratio"]]
        for what in ("ttft", "itl")
        for f in (figures[what],)
        for q in ("p50", "p90", "p99")
    ]  # fmt: skip
    print_table(
        f"{requests} requests over {seconds:g} s, 1 prefill + 1 decode (tiny), live vs simulated "
        f"(link {gbps:.2f} GB/s measured; simulation took {sim_s:.1f} s)",
        ["", "live (ms)", "simulated (ms)", "sim/live"],
        [[r[0] + " " + q, *r[1:]] for r, q in zip(rows, ["p50", "p90", "p99"] * 2, strict=True)],
    )


if __name__ == "__main__":
    main()

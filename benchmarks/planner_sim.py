"""The SLA planner against fixed splits, in the latency simulator: goodput and instance-seconds
of every fixed prefill/decode split of N instances, of a planner that sizes from mean lengths,
and of pdserve's planner, on loads whose mix shifts.

    python benchmarks/planner_sim.py [--quick] [--plot docs/assets/planned_timeline.png]

The cluster: the built-in tiny model's engine settings and its step time fit on this kind of
machine (`--step-model tiny-cpu`), N = 4 instances. Fixed splits: 1P3D, 2P2D, 3P1D. Planned
clusters start as 2P2D with `planner:` ttft_p90_s 1.0, itl_p90_s 0.02, interval_s 5, history_s
30, cooldown_s 10, confirm_intervals 2 and N instances in all, moved between the roles
(`elastic`: 2 to N instances, also added and retired); a role change takes 0.5 s after its
drain (`role_change.py`), a new instance 30 s from its start to its first step. Goodput: the
fraction of requests with TTFT ≤ 1.0 s and mean time per output token ≤ 0.02 s (a failed
request is not good). The same trace for every cluster.

Workloads (512-token blocks):
  * `shifting` — generated (`services.simulator.trace.shifting`): retrieval (a popular document
    of 2-7 blocks + a question, answers 16-64 tokens) at 7 requests/s, then chat (a short
    message, answers 128-512 tokens) at 20 requests/s, then retrieval; 180 s each (quick: 60 s).
  * `documents_trace`, `sample_trace` — the committed traces (benchmarks/workloads/), time
    compressed ×0.5 and ×0.25 (their 2 minutes in one and half a minute).
The `mean` planner is pdserve's with one difference: it judges candidate splits on requests of
the recent mean lengths (as NVIDIA Dynamo's planner sizes), not on lengths drawn from their
distribution.

RESULT: per workload `W_vs_best` (the planner's goodput ÷ the best fixed split's, chosen in
hindsight), `W_vs_worst`, `W_seconds_vs_best` (its instance-seconds ÷ the best fixed split's),
`W_mean_vs_best` (the mean planner's goodput ÷ the best fixed split's), `W_elastic_vs_best`
and `W_elastic_seconds_vs_best`.
"""

import argparse
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from _common import finish, parse_args, print_table

from pdserve.config import ClusterConfig, PlannerConfig, load_cluster_config
from services.planner.simulated import Moves, PlannedSimulation
from services.simulator.cli import scale_time
from services.simulator.latency import LatencyResult, Simulation
from services.simulator.latency_report import plot_timeline, summarize
from services.simulator.profiles import cluster_spec, from_config, step_model
from services.simulator.trace import TraceRecord, load_trace, shifting

NAME = "planner_sim"
WORKLOADS_DIR = Path(__file__).resolve().parent / "workloads"
N = 4
TTFT_S, ITL_S = 1.0, 0.02
FIXED = [{"prefill": p, "decode": N - p} for p in range(1, N)]
PLANNED = ("planner", "mean", "elastic")  # pdserve's, sizing from means, 2..N instances


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plot", type=Path, help="write the planned shifting run's timeline")


def cluster_config(fewest: int = N) -> ClusterConfig:
    planner = PlannerConfig(
        enabled=True, ttft_p90_s=TTFT_S, itl_p90_s=ITL_S, interval_s=5.0, history_s=30.0,
        cooldown_s=10.0, confirm_intervals=2, min_instances=fewest, max_instances=N,
        max_prefill=N - 1, max_decode=N - 1,
    )  # fmt: skip
    return replace(load_cluster_config(None), planner=planner)


def workloads(quick: bool) -> dict[str, list[TraceRecord]]:
    phase = 60.0 if quick else 180.0
    trace = shifting(100_000, phase_s=phase, rag_rate_per_s=7.0, chat_rate_per_s=20.0)
    return {
        "shifting": [r for r in trace if r.timestamp_ms < 3 * phase * 1000],
        "documents_trace": scale_time(load_trace(WORKLOADS_DIR / "documents_trace.jsonl"), 0.5),
        "sample_trace": scale_time(load_trace(WORKLOADS_DIR / "sample_trace.jsonl"), 0.25),
    }


def replay(job: tuple[str, str, bool, Path | None]) -> dict[str, Any]:
    """One cluster (a fixed split "1P3D"..., or a planner's sizing) on one workload."""
    workload, cluster, quick, plot = job
    records = workloads(quick)[workload]
    config = cluster_config(2 if cluster == "elastic" else N)
    profiles = from_config(config, step_model("tiny-cpu"), None)
    result: LatencyResult
    changes: list[str] = []
    if cluster in PLANNED:
        sizing = "mean" if cluster == "mean" else "distribution"
        planned = PlannedSimulation(config, profiles, {"prefill": 2, "decode": 2},
                                    moves=Moves(0.5, 30.0), sizing=sizing)  # fmt: skip
        result = planned.run(records)
        changes = [f"{d.at - result.started:.0f}s {d.current}->{d.target}"
                   for d in planned.decisions if d.action == "change"]  # fmt: skip
        if plot is not None and cluster == "planner" and workload == "shifting":
            plot_timeline(result, plot, TTFT_S)
    else:
        counts = FIXED[int(cluster[0]) - 1]
        result = Simulation(cluster_spec(config, profiles, counts, None, 32_000), 512).run(records)
    summary = summarize(result, TTFT_S, ITL_S)
    return {"workload": workload, "cluster": cluster, "goodput": summary["goodput"],
            "instance_seconds": summary["instance_seconds"], "ttft_p90_s": summary["ttft_s"]["p90"],
            "tpot_p90_s": summary["tpot_s"]["p90"], "failed": summary["failed"],
            "requests": summary["requests"], "changes": changes}  # fmt: skip


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    clusters = [f"{c['prefill']}P{c['decode']}D" for c in FIXED] + list(PLANNED)
    jobs = [(w, c, args.quick, args.plot) for w in workloads(args.quick) for c in clusters]
    jobs.sort(key=lambda job: job[1] not in PLANNED)  # the long ones first
    with ProcessPoolExecutor(2) as pool:
        rows = list(pool.map(replay, jobs))
    metrics: dict[str, float] = {}
    table = []
    for workload in workloads(args.quick):
        mine = {r["cluster"]: r for r in rows if r["workload"] == workload}
        fixed = [mine[c] for c in clusters if c not in PLANNED]
        best = max(fixed, key=lambda r: (r["goodput"], -r["instance_seconds"]))
        worst = min(fixed, key=lambda r: r["goodput"])
        planner, mean, elastic = mine["planner"], mine["mean"], mine["elastic"]
        metrics[f"{workload}_vs_best"] = planner["goodput"] / best["goodput"]
        metrics[f"{workload}_vs_worst"] = planner["goodput"] / max(worst["goodput"], 1e-9)
        metrics[f"{workload}_seconds_vs_best"] = (planner["instance_seconds"]
                                                  / best["instance_seconds"])  # fmt: skip
        metrics[f"{workload}_mean_vs_best"] = mean["goodput"] / best["goodput"]
        metrics[f"{workload}_elastic_vs_best"] = elastic["goodput"] / best["goodput"]
        metrics[f"{workload}_elastic_seconds_vs_best"] = (elastic["instance_seconds"]
                                                          / best["instance_seconds"])  # fmt: skip
        for name in clusters:
            r = mine[name]
            label = {"mean": "planner (means)", "elastic": f"planner (2-{N})"}.get(name, name)
            table.append([workload, label, r["goodput"], r["instance_seconds"], r["ttft_p90_s"],
                          r["tpot_p90_s"], r["failed"], len(r["changes"])])  # fmt: skip
    print_table(
        f"goodput (TTFT <= {TTFT_S} s, TPOT <= {ITL_S} s) and instance-seconds, N = {N}",
        ["workload", "cluster", "goodput", "inst-s", "TTFT p90", "TPOT p90", "failed", "moves"],
        table,
    )
    finish(NAME, args, {"rows": rows}, metrics)


if __name__ == "__main__":
    main()

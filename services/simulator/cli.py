"""`pdserve simulate`: the capacity-planning questions answered by replaying a trace. By default
"how much device and storage cache, how many instances, which policies?" (hit rates over a
sweep); with `--latency`, "what TTFT and ITL does this cluster give this trace?" (a simulated
cluster in simulated time: `services.simulator.latency`)."""

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pdserve.config import EngineConfig, load_cluster_config
from pdserve.errors import ConfigError, InvalidRequestError
from services.planner.evaluate import SIZINGS
from services.planner.simulated import Moves, PlannedSimulation
from services.simulator.latency import ClusterSpec, Simulation
from services.simulator.latency_report import format_summary, plot_timeline, summarize
from services.simulator.profiles import (
    STEP_MODELS,
    cluster_spec,
    from_config,
    from_instances,
    measured_messages,
    step_model,
)
from services.simulator.replay import SimConfig
from services.simulator.report import Sweep, format_table, plot, run_sweep, write_json
from services.simulator.trace import BUILT_IN, TraceRecord, built_in, load_trace

ENGINE = EngineConfig()  # the instances' defaults: what a replay compares against by default


def add_parser(commands: Any) -> None:
    sim = commands.add_parser(
        "simulate",
        help="replay a trace through the real cache manager and routing policies (no model)",
    )
    sim.add_argument(
        "trace", help=f"JSON-lines trace file, or a built-in workload: {', '.join(BUILT_IN)}"
    )
    sim.add_argument("--requests", type=int, default=12_000, help="records to replay (12000)")
    sim.add_argument("--seed", type=int, default=0, help="seed of a built-in workload")
    sim.add_argument("--block-tokens", type=int, default=512, help="tokens per hash id (512)")
    sim.add_argument("--device-blocks", default="1024,4096,16384", help="per instance, a list")
    sim.add_argument("--storage-blocks", default="0", help="storage tier sizes, a list")
    sim.add_argument("--instances", default="1", help="instance counts, a list")
    policies = dict.fromkeys([ENGINE.eviction_policy, "lru"])  # the engine's default first
    sim.add_argument("--eviction", default=",".join(policies),
                     help="eviction policies, a list (the engine's default and lru)")  # fmt: skip
    sim.add_argument("--routing", default="cache_aware", help="routing policies, a list")
    sim.add_argument("--load-weight", type=float, default=0.1, help="cache_aware load_weight")
    half_life = ENGINE.lrfu_half_life_s
    sim.add_argument("--half-life-s", type=float, default=half_life,
                     help=f"lrfu half-life ({half_life:g}: the engine's)")  # fmt: skip
    holding = "sets how long requests hold blocks"
    sim.add_argument("--prefill-tokens-per-s", type=float, default=20_000.0,
                     help=f"one instance's prefill speed ({holding})")  # fmt: skip
    sim.add_argument("--time-per-output-token-s", type=float, default=0.02,
                     help=f"decode time per output token ({holding})")  # fmt: skip
    sim.add_argument("--json", type=Path, help="write the report as JSON here")
    sim.add_argument("--plot", type=Path, help="write a PNG of hit rate vs capacity here")
    sim.add_argument("--quiet", action="store_true", help="no progress bar")
    latency = sim.add_argument_group("latency mode (--latency)")
    latency.add_argument("--latency", action="store_true",
                         help="simulate TTFT and ITL instead of hit rates")  # fmt: skip
    latency.add_argument("--config", help="cluster config: roles, engine, router settings")
    latency.add_argument("--from-cluster", type=Path,
                         help="`pdserve admin list --json` of a running cluster: each role's "
                              "step time fit, KV pool and instance count")  # fmt: skip
    latency.add_argument("--step-model", default="tiny-cpu",
                         help=f"without --from-cluster: {', '.join(STEP_MODELS)} or a JSON file of "
                              "coefficients (tiny-cpu)")  # fmt: skip
    latency.add_argument(
        "--kv-blocks", type=int, help="KV blocks per instance (without --from-cluster)"
    )
    for role in ("prefill", "decode", "mixed"):
        latency.add_argument(
            f"--{role}", type=int, help=f"{role} instances (default: the config's)"
        )
    latency.add_argument("--transfer-gbps", type=float,
                         help="KV bytes GB/s (default: router.kv_transfer_gbps)")  # fmt: skip
    latency.add_argument("--rpc-ms", type=float, default=None,
                         help="one message between processes, one way (default: drawn "
                              "from the router's measured ones with --from-cluster, else "
                              "0)")  # fmt: skip
    latency.add_argument("--time-scale", type=float, default=1.0,
                         help="multiply the trace's timestamps (0.5: twice the rate)")  # fmt: skip
    latency.add_argument("--ttft-slo-s", type=float, default=2.0, help="goodput's TTFT SLO (2)")
    latency.add_argument("--itl-slo-s", type=float, default=0.2, help="goodput's ITL SLO (0.2)")
    latency.add_argument("--vocab-size", type=int, default=32_000,
                         help="prompt tokens are drawn below it (32000)")  # fmt: skip
    latency.add_argument("--planner", action="store_true",
                         help="the SLA planner reshapes the cluster as the trace goes (the "
                              "config's planner: settings; targets: the SLOs)")  # fmt: skip
    latency.add_argument("--planner-sizing", choices=SIZINGS, default="distribution",
                         help="judge splits on lengths drawn from the recent distribution, or "
                              "on their means (distribution)")  # fmt: skip
    latency.add_argument("--role-change-s", type=float, default=Moves().role_change_s,
                         help="with --planner: a role change after its drain (0.5)")  # fmt: skip
    latency.add_argument("--start-s", type=float, default=Moves().start_s,
                         help="with --planner: a new instance from its start to its first "
                              "step (30)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if args.trace in BUILT_IN:
        records = built_in(args.trace, args.requests, args.seed, args.block_tokens)
    else:
        path = Path(args.trace)
        if not path.is_file():
            raise InvalidRequestError(
                f"no trace file {path} (built-in workloads: {', '.join(BUILT_IN)})"
            )
        records = load_trace(path, args.requests)
    if not records:
        raise InvalidRequestError(f"{args.trace}: no records")
    if args.latency:
        return run_latency(records, args)
    sweep = Sweep(
        device_blocks=_ints(args.device_blocks, "--device-blocks"),
        storage_blocks=_ints(args.storage_blocks, "--storage-blocks", zero=True),
        instances=_ints(args.instances, "--instances"),
        evictions=_words(args.eviction),
        routings=_words(args.routing),
    )
    base = SimConfig(
        device_blocks=1,
        block_tokens=args.block_tokens,
        load_weight=args.load_weight,
        half_life_s=args.half_life_s,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        time_per_output_token_s=args.time_per_output_token_s,
    )
    try:
        report = run_sweep(records, sweep, base, progress=not args.quiet and sys.stderr.isatty())
    except ValueError as e:  # an unknown policy name
        raise InvalidRequestError(str(e)) from e
    return _report(args, len(records), format_table(report), report,
                   lambda path: plot(report, path))  # fmt: skip


def run_latency(records: list[TraceRecord], args: argparse.Namespace) -> int:
    if args.time_scale <= 0:
        raise InvalidRequestError("--time-scale must be positive")
    records = scale_time(records, args.time_scale)
    spec = latency_spec(args)
    bar = tqdm(total=len(records), unit="req", disable=args.quiet or not sys.stderr.isatty(),
               leave=False)  # fmt: skip
    moves: list[str] = []
    if args.planner:
        planned = planned_simulation(spec, args)
        result = planned.run(records, lambda: bar.update(1))
        moves = [f"{d.at - result.started:8.1f} s  {d.current} -> {d.target}: {d.reason}"
                 for d in planned.decisions if d.action == "change"]  # fmt: skip
    else:
        result = Simulation(spec, args.block_tokens, args.seed).run(records, lambda: bar.update(1))
    bar.close()
    summary = summarize(result, args.ttft_slo_s, args.itl_slo_s)
    text = format_summary(summary)
    if args.planner:
        summary["planner_moves"] = moves
        text += f"\nthe planner's moves ({len(moves)}):" + "".join(f"\n{m}" for m in moves)
    return _report(args, len(records), text, summary,
                   lambda path: plot_timeline(result, path, args.ttft_slo_s))  # fmt: skip


def planned_simulation(spec: ClusterSpec, args: argparse.Namespace) -> PlannedSimulation:
    """The simulated cluster of `spec` with the config's planner, its targets the SLOs."""
    config = load_cluster_config(args.config)
    try:
        config = replace(config, planner=replace(config.planner, ttft_p90_s=args.ttft_slo_s,
                                                 itl_p90_s=args.itl_slo_s))  # fmt: skip
        return PlannedSimulation(
            config,
            spec.profiles,
            {"prefill": spec.prefill, "decode": spec.decode, "mixed": spec.mixed},
            transfer_gbps=spec.transfer_gbps,
            vocab_size=spec.vocab_size,
            block_tokens=args.block_tokens,
            moves=Moves(args.role_change_s, args.start_s),
            sizing=args.planner_sizing,
            rpc_s=spec.rpc_s,
            rpc_draws_s=spec.rpc_draws_s,
            seed=args.seed,
        )
    except ConfigError as e:
        raise InvalidRequestError(str(e)) from e


def _report(
    args: argparse.Namespace,
    requests: int,
    text: str,
    report: dict[str, Any],
    draw: Callable[[Path], None],
) -> int:
    """Print the report, and write it as JSON (`--json`) and its plot (`--plot`)."""
    print(f"{requests} requests from {args.trace}")
    print(text)
    if args.json:
        write_json(report, args.json)
        print(f"report: {args.json}")
    if args.plot:
        draw(args.plot)
        print(f"plot: {args.plot}")
    return 0


def latency_spec(args: argparse.Namespace) -> ClusterSpec:
    """The simulated cluster of `--config`, `--from-cluster` or `--step-model`, and the role
    counts given."""
    config = load_cluster_config(args.config)
    rpc_s = 0.0 if args.rpc_ms is None else args.rpc_ms / 1000
    draws: tuple[float, ...] = ()
    if args.from_cluster is not None:
        profiles, counts = from_instances(args.from_cluster, config)
        if args.rpc_ms is None:
            rpc_s, draws = measured_messages(args.from_cluster)
    else:
        profiles = from_config(config, step_model(args.step_model), args.kv_blocks)
        counts = {role: getattr(config, role).replicas for role in profiles}
    for role in ("prefill", "decode", "mixed"):
        if getattr(args, role) is not None:
            counts[role] = getattr(args, role)
    if counts.get("mixed") and args.prefill is None and args.decode is None:
        counts["prefill"] = counts["decode"] = 0
    try:
        return cluster_spec(config, profiles, counts, args.transfer_gbps, args.vocab_size, rpc_s,
                            draws)  # fmt: skip
    except ConfigError as e:
        raise InvalidRequestError(str(e)) from e


def scale_time(records: list[TraceRecord], factor: float) -> list[TraceRecord]:
    """The records with timestamps × `factor` from the first one."""
    if factor == 1.0 or not records:
        return records
    start = records[0].timestamp_ms
    return [replace(r, timestamp_ms=start + (r.timestamp_ms - start) * factor) for r in records]


def _ints(text: str, option: str, zero: bool = False) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise InvalidRequestError(f"{option} takes a comma-separated list of integers") from None
    if any(v < (0 if zero else 1) for v in values):
        raise InvalidRequestError(f"{option} values must be {'>= 0' if zero else 'positive'}")
    return values


def _words(text: str) -> tuple[str, ...]:
    return tuple(w.strip() for w in text.split(",") if w.strip())

"""`pdserve simulate`: the capacity-planning question ("how much device and storage cache, how
many instances, which policies, for this trace?") answered by replaying the trace."""

import argparse
import sys
from pathlib import Path
from typing import Any

from pdserve.errors import InvalidRequestError
from services.simulator.replay import SimConfig
from services.simulator.report import Sweep, format_table, plot, run_sweep, write_json
from services.simulator.trace import BUILT_IN, built_in, load_trace


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
    sim.add_argument("--eviction", default="lru,lrfu", help="eviction policies, a list")
    sim.add_argument("--routing", default="cache_aware", help="routing policies, a list")
    sim.add_argument("--load-weight", type=float, default=0.1, help="cache_aware load_weight")
    sim.add_argument("--half-life-s", type=float, default=60.0, help="lrfu half-life")
    holding = "sets how long requests hold blocks"
    sim.add_argument("--prefill-tokens-per-s", type=float, default=20_000.0,
                     help=f"one instance's prefill speed ({holding})")  # fmt: skip
    sim.add_argument("--time-per-output-token-s", type=float, default=0.02,
                     help=f"decode time per output token ({holding})")  # fmt: skip
    sim.add_argument("--json", type=Path, help="write the report as JSON here")
    sim.add_argument("--plot", type=Path, help="write a PNG of hit rate vs capacity here")
    sim.add_argument("--quiet", action="store_true", help="no progress bar")


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
    print(f"{len(records)} requests from {args.trace}")
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
        print(f"report: {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"plot: {args.plot}")
    return 0


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

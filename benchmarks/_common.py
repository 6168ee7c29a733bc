"""Shared plumbing for the benchmark scripts.

Every benchmark is run as ``python benchmarks/<name>.py [--quick]``: it prints a readable table,
writes ``benchmarks/results/<name>.json`` (figures, the arguments and machine information) and
ends its output with the line ``RESULT <name> key=value ...``. The machine is a shared, noisy box,
so figures are medians of several repetitions and, where possible, ratios against a baseline
measured in the same run.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# BENCHMARK_RESULTS_DIR: another directory (tests that run a benchmark keep its JSON there)
RESULTS_DIR = Path(
    os.environ.get("BENCHMARK_RESULTS_DIR") or Path(__file__).resolve().parent / "results"
)

Cell = str | int | float


def parse_args(
    description: str,
    configure: Callable[[argparse.ArgumentParser], None] | None = None,
    argv: Sequence[str] | None = None,
) -> argparse.Namespace:
    """The common flags (`--quick`, `--repeat`) plus those that `configure` adds."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--quick", action="store_true", help="small sizes and few repetitions (a few seconds)"
    )
    parser.add_argument(
        "--repeat", type=int, default=None, help="repetitions per figure (median); default by mode"
    )
    if configure is not None:
        configure(parser)
    args = parser.parse_args(argv)
    if args.repeat is not None and args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args


def repeats(args: argparse.Namespace, quick: int, full: int) -> int:
    """`--repeat` if given, else the mode's default."""
    if args.repeat is not None:
        return int(args.repeat)
    return quick if args.quick else full


def seconds_per_call(fn: Callable[[], object], number: int = 1) -> float:
    """Wall time of `number` back-to-back calls of `fn`, divided by `number`."""
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def median_seconds(
    fn: Callable[[], object], *, repeat: int, number: int = 1, warmup: int = 1
) -> float:
    """Median over `repeat` samples of `seconds_per_call(fn, number)`, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(seconds_per_call(fn, number) for _ in range(repeat))


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Cell]]) -> None:
    """Print `rows` under `headers`, numbers right-aligned."""

    def text(cell: Cell) -> str:
        if isinstance(cell, float):
            return f"{cell:,.1f}" if abs(cell) >= 100 else f"{cell:.3g}"
        return f"{cell:,}" if isinstance(cell, int) else cell

    cells = [[text(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    left = [bool(rows) and isinstance(rows[0][i], str) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        padded = (
            c.ljust(w) if flush_left else c.rjust(w)
            for c, w, flush_left in zip(row, widths, left, strict=True)
        )
        return "  ".join(padded).rstrip()

    print(f"\n{title}")
    print(line(headers))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print(line(row))


def machine_info() -> dict[str, Any]:
    """Python, torch and CPU facts that make a result comparable (or not) with another."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    return info


def format_value(value: float) -> str:
    """A RESULT value: integers as is, floats with 4 significant digits (no exponent below 1e9)."""
    if isinstance(value, int):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.4g}"


def finish(
    name: str,
    args: argparse.Namespace,
    results: Mapping[str, Any],
    metrics: Mapping[str, float],
) -> Path:
    """Write `benchmarks/results/<name>.json` and print the final `RESULT` line.

    `metrics` are the headline figures (they go in the RESULT line and the JSON); `results` holds
    everything else worth keeping.
    """
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    document = {
        "benchmark": name,
        "metrics": dict(metrics),
        "results": dict(results),
        "args": vars(args),
        "machine": machine_info(),
    }
    path.write_text(json.dumps(document, indent=2, sort_keys=False, default=str) + "\n")
    print(f"\nwrote {path}")
    print(f"RESULT {name} " + " ".join(f"{k}={format_value(v)}" for k, v in metrics.items()))
    return path

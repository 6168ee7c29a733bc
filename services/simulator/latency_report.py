"""What a latency simulation reports: TTFT and ITL percentiles, goodput against SLOs,
instance-seconds, as text, JSON and a timeline plot."""

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from services.simulator.latency import LatencyResult

PERCENTILES = (50, 90, 99)


def percentiles(values: Any) -> dict[str, float]:
    """p50/p90/p99 of `values` (nan when there are none)."""
    data = np.asarray(values, dtype=float)
    if not data.size:
        return {f"p{p}": float("nan") for p in PERCENTILES}
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(data, PERCENTILES),
                                                strict=True)}  # fmt: skip


def summarize(result: LatencyResult, ttft_slo_s: float, itl_slo_s: float) -> dict[str, Any]:
    """The run's figures. A request meets its SLOs when its time to first token is at most
    `ttft_slo_s` and the mean time between its output tokens at most `itl_slo_s` (a request of
    one token: the first only); goodput counts those."""
    served = [r for r in result.requests if not r.failed]
    ttfts = [r.ttft for r in served if r.ttft is not None]
    tpots = [t for r in served if (t := r.tpot) is not None]
    good = sum(
        1
        for r in served
        if r.ttft is not None and r.ttft <= ttft_slo_s and (r.tpot or 0.0) <= itl_slo_s
    )
    duration = max(result.ended - result.started, 1e-9)
    prompt = sum(r.prompt_tokens for r in served)
    return {
        "requests": len(result.requests),
        "failed": len(result.requests) - len(served),
        "failures": dict(Counter(r.failed.split(":")[0] for r in result.requests if r.failed)),
        "duration_s": duration,
        "ttft_s": percentiles(ttfts),
        "itl_s": percentiles(result.itl),
        "tpot_s": percentiles(tpots),
        "slo": {"ttft_s": ttft_slo_s, "itl_s": itl_slo_s},
        "goodput": good / max(len(result.requests), 1),
        "goodput_per_s": good / duration,
        "instances": dict(Counter(result.instance_names.values())),
        "instance_seconds": result.instance_seconds,
        "preemptions": result.preemptions,
        "paths": dict(Counter(r.path for r in served)),
        "cached_token_fraction": sum(r.cached_tokens for r in served) / max(prompt, 1),
        "output_tokens_per_s": sum(r.tokens for r in served) / duration,
    }


def format_summary(summary: dict[str, Any]) -> str:
    def row(name: str, values: dict[str, float]) -> str:
        cells = "  ".join(f"{k} {v * 1000:9.1f} ms" for k, v in values.items())
        return f"{name:5} {cells}"

    instances = ", ".join(f"{n} {role}" for role, n in sorted(summary["instances"].items()))
    paths = ", ".join(f"{n} {path}" for path, n in sorted(summary["paths"].items()))
    slo = summary["slo"]
    return "\n".join([
        f"{summary['requests']} requests over {summary['duration_s']:.1f} s on {instances} "
        f"({summary['failed']} failed{_reasons(summary['failures'])}; paths: {paths or 'none'})",
        row("TTFT", summary["ttft_s"]),
        row("ITL", summary["itl_s"]),
        row("TPOT", summary["tpot_s"]),
        f"goodput {summary['goodput']:.3f} of requests ({summary['goodput_per_s']:.2f}/s) "
        f"within TTFT {slo['ttft_s']:g} s and ITL {slo['itl_s']:g} s; "
        f"{summary['instance_seconds']:.0f} instance-seconds; "
        f"{summary['output_tokens_per_s']:.1f} output tokens/s; "
        f"{summary['cached_token_fraction']:.3f} of prompt tokens cached; "
        f"{summary['preemptions']} preemptions",
    ])  # fmt: skip


def plot_timeline(result: LatencyResult, path: Path, ttft_slo_s: float) -> None:
    """Four panels over simulated time: arrivals and completions per second; each request's
    TTFT at its arrival (the SLO drawn); running and waiting requests per role; instances per
    role (a planner's moves)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rate, ttft, load, counts) = plt.subplots(
        4, 1, figsize=(10, 11), sharex=True, height_ratios=(3, 3, 3, 1.5)
    )
    start = result.started
    span = max(result.ended - start, 1e-9)
    bins = np.linspace(0, span, min(200, max(10, int(span))) + 1)
    width = bins[1] - bins[0]
    arrivals = [r.arrival - start for r in result.requests]
    ends = [r.last_token - start for r in result.requests if r.last_token is not None]
    for values, label in ((arrivals, "arrivals"), (ends, "completions")):
        histogram, _ = np.histogram(values, bins)
        rate.step(bins[:-1], histogram / width, where="post", label=label)
    rate.set_ylabel("requests/s")
    rate.legend(fontsize=8)
    served = [r for r in result.requests if r.ttft is not None]
    ttft.scatter([r.arrival - start for r in served], [r.ttft for r in served], s=3)
    ttft.axhline(ttft_slo_s, color="red", linestyle="--", label=f"TTFT SLO {ttft_slo_s:g} s")
    ttft.set_yscale("log")
    ttft.set_ylabel("TTFT (s), by arrival")
    ttft.legend(fontsize=8)
    times = [s.at - start for s in result.samples]
    roles = sorted({row[0] for s in result.samples for row in s.instances.values()})
    for role in roles:
        mine = [[row for row in s.instances.values() if row[0] == role] for s in result.samples]
        load.plot(times, [sum(row[1] for row in rows) for rows in mine], label=f"{role} running")
        load.plot(times, [sum(row[2] for row in rows) for rows in mine], label=f"{role} waiting")
        counts.step(times, [len(rows) for rows in mine], where="post", label=role)
    load.set_ylabel("requests")
    load.legend(fontsize=8)
    counts.set_ylabel("instances")
    counts.set_xlabel("simulated seconds")
    counts.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _reasons(failures: dict[str, int]) -> str:
    return f": {', '.join(f'{n} {why}' for why, n in failures.items())}" if failures else ""

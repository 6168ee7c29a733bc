"""The capacity-planning grid: every configuration of a sweep replayed, next to the unlimited
cache and Belady's optimum, as a table, JSON and a plot."""

import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from services.simulator.optimum import belady, unlimited
from services.simulator.replay import SimConfig, Simulation
from services.simulator.trace import TraceRecord


@dataclass(frozen=True, slots=True)
class Sweep:
    device_blocks: tuple[int, ...]
    storage_blocks: tuple[int, ...] = (0,)
    instances: tuple[int, ...] = (1,)
    evictions: tuple[str, ...] = ("lru", "lrfu")
    routings: tuple[str, ...] = ("cache_aware",)

    def configs(self, base: SimConfig) -> list[SimConfig]:
        grid = itertools.product(
            self.device_blocks, self.storage_blocks, self.instances, self.evictions, self.routings
        )
        return [
            replace(base, device_blocks=d, storage_blocks=s, instances=n, eviction=e, routing=r)
            for d, s, n, e, r in grid
        ]


def run_sweep(
    records: Sequence[TraceRecord], sweep: Sweep, base: SimConfig, progress: bool = True
) -> dict[str, Any]:
    """Replay every configuration; returns the report (rows, references) as plain data."""
    configs = sweep.configs(base)
    bar = tqdm(total=len(configs) * len(records), unit="req", disable=not progress, leave=False)
    rows = []
    for config in configs:
        result = Simulation(config).run(records, lambda: bar.update(1))
        rows.append({
            **asdict(config),
            **result.cluster.rates(),
            "per_instance": [t.rates() for t in result.per_instance],
            "waited": result.waited,
            "too_large": result.too_large,
        })  # fmt: skip
    bar.close()
    totals = sorted({d * n for d in sweep.device_blocks for n in sweep.instances})
    references: dict[str, Any] = {
        "unlimited": unlimited(records, base.block_tokens).rates()["total"],
        "belady": {str(c): belady(records, base.block_tokens, c).rates()["total"] for c in totals},
    }
    for row in rows:
        optimum = references["belady"][str(row["device_blocks"] * row["instances"])]
        row["device_vs_belady"] = row["device"] / optimum if optimum else 0.0
    return {"requests": len(records), "rows": rows, "references": references}


def format_table(report: dict[str, Any]) -> str:
    headers = ["device", "storage", "inst", "eviction", "routing", "device hit", "storage hit",
               "total", "per-req", "vs belady"]  # fmt: skip
    lines = []
    for r in report["rows"]:
        lines.append([
            str(r["device_blocks"]), str(r["storage_blocks"]), str(r["instances"]),
            r["eviction"], r["routing"], f"{r['device']:.3f}", f"{r['storage']:.3f}",
            f"{r['total']:.3f}", f"{r['total_per_request']:.3f}", f"{r['device_vs_belady']:.2f}",
        ])  # fmt: skip
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    refs = report["references"]
    belady_text = ", ".join(f"{c} blocks {v:.3f}" for c, v in refs["belady"].items())
    out.append(f"unlimited cache {refs['unlimited']:.3f}; Belady (one cache): {belady_text}")
    return "\n".join(out)


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


def plot(report: dict[str, Any], path: Path) -> None:
    """Hit rate against device capacity, one line per policy, one panel per storage size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    storages = sorted({r["storage_blocks"] for r in rows})
    figure, axes = plt.subplots(1, len(storages), figsize=(5 * len(storages), 4), squeeze=False)
    for ax, storage in zip(axes[0], storages, strict=True):
        lines: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if r["storage_blocks"] == storage:
                label = f"{r['eviction']}/{r['routing']} x{r['instances']}"
                lines.setdefault(label, []).append((r["device_blocks"], r["total"]))
        for label, points in sorted(lines.items()):
            xs, ys = zip(*sorted(points), strict=True)
            ax.plot(xs, ys, marker="o", label=label)
        belady_points = sorted((int(c), v) for c, v in report["references"]["belady"].items())
        xs, ys = zip(*belady_points, strict=True)
        ax.plot(xs, ys, linestyle="--", color="black", label="Belady (one cache)")
        ax.axhline(report["references"]["unlimited"], linestyle=":", color="grey",
                   label="unlimited")  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("device blocks per instance")
        ax.set_ylabel("hit rate (blocks)")
        ax.set_title(f"storage {storage} blocks")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)

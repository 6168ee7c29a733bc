"""Where an instance's GIL goes per engine step, with and without serving traffic.

    .venv/bin/python benchmarks/engine_gil.py [--quick] [--repeat N] [--batch 64]
        [--window-s 6] [--threads 2] [--rate 200]

Two setups on the same engine settings (the built-in tiny model, float32, `--threads` torch
threads, KV block 32, 1 GiB of KV cache, prefix caching off: as `vs_vllm_online` runs pdserve),
alternated `--repeat` times:

* `engine`: the engine alone on its loop (`EngineLoop`: the engine thread and its output thread,
  which adds the text and stop strings), in a child process; the outputs are dropped there.
* `served`: `pdserve up` with one mixed instance and its router; the requests are streaming
  `/v1/completions` through the router (a raw asyncio HTTP client here), so the instance also
  runs its gRPC server, the output subscription and the step messages.

Both run `--batch` requests of a 32-token prompt with `ignore_eos` and enough tokens to outlast
the window, all in the running batch at once. Once they all decode, py-spy samples the engine's
process for `--window-s` seconds at `--rate` Hz recording only the thread that holds the GIL
(`py-spy record --gil --threads`), while the engine's step counters (`pdserve_engine_steps`,
`pdserve_engine_step_seconds`) are read at both ends.

Per setup, medians over repetitions: `step_ms` (wall time inside `LLMEngine.step`), `cycle_ms`
(wall time per step of the loop: the step plus what runs between steps), `gil_ms` (GIL held per
step, any thread), split into the engine thread (`engine-loop`), the output thread
(`engine-outputs`) and every other thread (gRPC, asyncio, metrics). py-spy samples the GIL's
holder, so these are estimates with the sampling's granularity (1 / `--rate` s).

Writes `benchmarks/results/engine_gil.json` and ends with `RESULT engine_gil step_ms_engine=…
step_ms_served=… cycle_ms_engine=… cycle_ms_served=… gil_ms_engine=… gil_ms_served=…
gil_engine_thread_ms_served=… gil_outputs_ms_served=… gil_other_ms_served=… served_vs_engine=…`
(`served_vs_engine`: cycle time served ÷ alone; 1.0 means serving costs the engine nothing).
"""

import argparse
import asyncio
import collections
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from _common import finish, median, parse_args, print_table, repeats
from _online import PdserveCluster
from vs_vllm import tiny_model_dir

NAME = "engine_gil"
ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 32
MAX_TOKENS = 4000  # within the tiny model's 4,096-token context; outlasts the window
WARM_STEPS = 300  # both setups are sampled from the same point of their requests
THREADS = {"engine-loop": "engine_thread", "engine-outputs": "outputs"}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=64, help="requests decoding at once")
    parser.add_argument("--window-s", type=float, default=None, help="seconds sampled")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the engine")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--start-timeout-s", type=float, default=600.0)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": str(tiny_model_dir()),
        "dtype": "float32",
        "torch_threads": args.threads,
        "block_size": 32,
        "kv_cache_bytes": 1 << 30,
        "max_num_seqs": args.batch,
        "max_num_batched_tokens": 512,
        "enable_prefix_caching": False,
    }


def prompt(index: int) -> list[int]:
    return [(7 * index + 5 * i + 3) % 250 for i in range(PROMPT_TOKENS)]


# -- the engine alone ---------------------------------------------------------------------------


def engine_process(conn: Connection, settings: dict[str, Any], batch: int) -> None:
    """An engine on its loop with `batch` long requests; answers each message with its step
    counters and running batch, until None."""
    from pdserve.config import load_engine_config
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.loop import EngineLoop
    from pdserve.engine.request import SamplingParams

    engine = LLMEngine.from_config(load_engine_config(env={}, overrides=settings))
    loop = EngineLoop(engine, lambda outputs: None)
    loop.start()
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(batch):
        loop.call(lambda e, i=i: e.add_request(prompt(i), params))
    conn.send(os.getpid())
    while conn.recv() is not None:
        conn.send(loop.call(_counters))
    loop.stop()


def _counters(engine: Any) -> tuple[int, float, int]:
    stats = engine.scheduler.stats
    return stats.num_steps, stats.step_seconds, len(engine.scheduler.running)


class EngineAlone:
    def __init__(self, args: argparse.Namespace) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=engine_process, args=(child, engine_settings(args), args.batch), daemon=True
        )
        self.process.start()
        self.pid: int = self.conn.recv()

    def counters(self) -> tuple[int, float, int]:
        self.conn.send("stats")
        steps, seconds, running = self.conn.recv()
        return int(steps), float(seconds), int(running)

    def close(self) -> None:
        self.conn.send(None)
        self.process.join(30)


# -- served through the router ------------------------------------------------------------------


class Served:
    """`pdserve up` (one mixed instance) with `batch` streaming requests open through its
    router, read and dropped by an asyncio client on its own thread."""

    def __init__(self, args: argparse.Namespace) -> None:
        config = {
            "engine": engine_settings(args),
            "prefill": {"replicas": 0},
            "decode": {"replicas": 0},
            "mixed": {"replicas": 1, "num_cpus": 1},
            "storage": {"enabled": False},
            "router": {"model_name": "tiny", "max_concurrent_requests": 4 * args.batch},
        }
        env = dict(os.environ) | {
            "OMP_NUM_THREADS": str(args.threads),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        self.cluster = PdserveCluster("engine_gil", config, env, args.start_timeout_s, ROOT)
        self.cluster.start()
        [instance] = self.cluster.instances
        self.pid = int(instance["pid"])
        self.metrics_url = f"http://{instance['metrics_address']}/metrics"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        host, port = self.cluster.url.removeprefix("http://").rsplit(":", 1)
        self.streams: list[Future[None]] = [
            asyncio.run_coroutine_threadsafe(_stream(host, int(port), i), self.loop)
            for i in range(args.batch)
        ]

    def counters(self) -> tuple[int, float, int]:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as reply:
            text = reply.read().decode()
        values = {}
        for line in text.splitlines():
            if line.startswith("pdserve_"):
                name, _, value = line.rpartition(" ")
                values[name.split("{", 1)[0]] = float(value)
        return (
            int(values["pdserve_engine_steps_total"]),
            values["pdserve_engine_step_seconds_total"],
            int(values["pdserve_running_requests"]),
        )

    def close(self) -> None:
        """Close the connections (the router aborts their requests), then stop the cluster."""
        asyncio.run_coroutine_threadsafe(_cancel(self.streams), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        self.cluster.stop()


async def _cancel(streams: list["Future[None]"]) -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for stream in streams:
        stream.cancel()


async def _stream(host: str, port: int, index: int) -> None:
    request = {"model": "tiny", "prompt": prompt(index), "max_tokens": MAX_TOKENS,
               "stream": True, "ignore_eos": True, "temperature": 0}  # fmt: skip
    body = json.dumps(request).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(head + body)
        while await reader.read(1 << 16):
            pass
    finally:
        writer.close()


# -- measuring ----------------------------------------------------------------------------------


def wait_decoding(counters: Callable[[], tuple[int, float, int]], batch: int) -> None:
    """Until every request is in the running batch and the engine ran `WARM_STEPS` steps."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        steps, _, running = counters()
        if running == batch and steps >= WARM_STEPS:
            return
        time.sleep(0.05)
    raise RuntimeError(f"the batch did not reach {batch} running requests")


def gil_samples(py_spy: str, pid: int, window_s: float, rate: int) -> dict[str, int]:
    """GIL-holding samples per thread name over the window."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "gil.txt"
        subprocess.run(
            [py_spy, "record", "-p", str(pid), "-d", f"{window_s:g}", "-r", str(rate), "--gil",
             "--threads", "--nonblocking", "--format", "raw", "-o", str(out)],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        lines = out.read_text().splitlines()
    per_thread: collections.Counter[str] = collections.Counter()
    for line in lines:
        stack, _, count = line.rpartition(" ")
        thread = stack.split(";", 1)[0].split(": ", 1)[-1]
        per_thread[THREADS.get(thread, "other")] += int(count)
    return dict(per_thread)


def measure(setup: Any, args: argparse.Namespace, py_spy: str, window_s: float) -> dict[str, float]:
    wait_decoding(setup.counters, args.batch)
    steps0, seconds0, _ = setup.counters()
    started = time.perf_counter()
    samples = gil_samples(py_spy, setup.pid, window_s, args.rate)
    wall = time.perf_counter() - started
    steps1, seconds1, running = setup.counters()
    if running != args.batch:
        raise RuntimeError(f"the batch changed during the window ({running} running)")
    steps = steps1 - steps0
    sampled_steps = steps * window_s / wall  # the steps py-spy saw: it samples `window_s`

    def per_step_ms(count: int) -> float:
        return 1000.0 * count / args.rate / sampled_steps

    figures = {
        "steps": float(steps),
        "step_ms": 1000.0 * (seconds1 - seconds0) / steps,
        "cycle_ms": 1000.0 * wall / steps,
        "gil_ms": per_step_ms(sum(samples.values())),
    }
    for name in ("engine_thread", "outputs", "other"):
        figures[f"gil_{name}_ms"] = per_step_ms(samples.get(name, 0))
    return figures


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    repeat = repeats(args, quick=1, full=3)
    window_s = args.window_s or (3.0 if args.quick else 6.0)
    py_spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("py-spy is not installed (make install puts it in .venv)")
    setups: dict[str, Callable[[argparse.Namespace], Any]] = {
        "engine": EngineAlone, "served": Served,
    }  # fmt: skip
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in setups}
    for rep in range(repeat):
        order = list(setups) if rep % 2 == 0 else list(reversed(setups))
        for name in order:
            setup = setups[name](args)
            try:
                samples[name].append(measure(setup, args, py_spy, window_s))
            finally:
                setup.close()
            print(f"rep {rep + 1}/{repeat} {name}: {samples[name][-1]}", flush=True)
    keys = ["step_ms", "cycle_ms", "gil_ms", "gil_engine_thread_ms", "gil_outputs_ms",
            "gil_other_ms"]  # fmt: skip
    medians = {
        name: {k: median([s[k] for s in runs]) for k in keys} for name, runs in samples.items()
    }
    print_table(
        f"batch {args.batch}, per engine step (ms, medians of {repeat})",
        ["setup", *keys],
        [[name, *(medians[name][k] for k in keys)] for name in setups],
    )
    metrics = {f"{k}_{name}": medians[name][k] for name in setups for k in keys[:3]}
    for k in keys[3:]:
        metrics[f"{k}_served"] = medians["served"][k]
    metrics["served_vs_engine"] = medians["served"]["cycle_ms"] / medians["engine"]["cycle_ms"]
    finish(NAME, args, {"samples": samples, "medians": medians, "window_s": window_s}, metrics)


if __name__ == "__main__":
    main()

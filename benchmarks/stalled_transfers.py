"""Stalled KV transfers: how long a request waits before it is served by another pair.

    python benchmarks/stalled_transfers.py [--quick] [--requests 20] [--stall-timeout-s 1]

For each transport (gRPC PushKV, shared memory, Mooncake over TCP): an in-process cluster of the
built-in tiny model, 1 prefill + 2 decode instances, a router on the OpenAI API,
`transfer.stall_timeout_s` set to `--stall-timeout-s`. Each of `--requests` distinct 64-token
prompts is sent twice, greedy, `max_tokens` 8: once undisturbed, then with its first transfer
stalled by the decode instance that receives it (the test fault hook holds the gRPC stream's
first chunk, or the direct write's commit, and never lets go while the request is served).

Per transport: requests failed (must be 0), stalled texts unlike their undisturbed run (must be
0), the time from the stall to the retried transfer reaching the other decode instance (the
stall is cut after `stall_timeout_s`, the reservation aborted, the pair chosen again) p50/p99,
and the stalled request's latency minus its undisturbed run's, median.

RESULT: `failover_p99_s_<transport>`, `failed`, `wrong_texts`, `stall_timeout_s`.
"""

import argparse
import logging
import threading
import time
from typing import Any

import httpx
import numpy as np
from _common import finish, parse_args, print_table

from pdserve.config import DecodeConfig, EngineConfig, PrefillConfig, RouterConfig, TransferConfig
from pdserve.rpc.auth import new_secret

NAME = "stalled_transfers"
MODEL_NAME = "tiny"
SECRET = new_secret()
TRANSPORTS = ("grpc", "shm", "mooncake")
PROMPT_TOKENS = 64
MAX_TOKENS = 8

logger = logging.getLogger(NAME)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=None, help="stalled requests per transport")
    parser.add_argument("--stall-timeout-s", type=float, default=1.0)


class StallNext:
    """The decode instances' fault hook. Once armed, the next transfer call is held (a
    transfer that neither ends nor fails) until the next call after it, which is the request's
    retry on the other instance (requests are sent one at a time); then it is let go (its
    reservation is gone by then) and the hook disarms. Records each episode's times."""

    def __init__(self) -> None:
        self.episodes: list[tuple[float, float]] = []  # (stalled at, retry arrived at)
        self._armed = False
        self._stalled_at: float | None = None
        self._release = threading.Event()
        self._lock = threading.Lock()

    def arm(self) -> None:
        with self._lock:
            self._armed, self._stalled_at = True, None
            self._release = threading.Event()

    def __call__(self, request_id: str, first_block: int) -> None:
        with self._lock:
            if not self._armed:
                return
            if self._stalled_at is not None:  # the retry
                self.episodes.append((self._stalled_at, time.monotonic()))
                self._armed = False
                self._release.set()
                return
            self._stalled_at = time.monotonic()
            release = self._release
        release.wait(120)

    def release(self) -> None:
        with self._lock:
            self._armed = False
            self._release.set()


class Cluster:
    def __init__(self, transport: str, stall_timeout_s: float, hook: StallNext) -> None:
        from services.decode.servicer import serve_decode
        from services.prefill.servicer import serve_prefill
        from services.router.server import serve_router

        engine = EngineConfig(model=None, torch_threads=1, num_kv_blocks=1024)
        transfer = TransferConfig(transport=transport, stall_timeout_s=stall_timeout_s)
        self.members = [
            serve_prefill(engine, PrefillConfig(), transfer=transfer, secret=SECRET),
            *(serve_decode(engine, DecodeConfig(), transfer=transfer, secret=SECRET)
              for _ in range(2)),
        ]  # fmt: skip
        for instance, _, _ in self.members[1:]:
            instance.kv_write_fault = hook
        addresses = [f"127.0.0.1:{port}" for _, _, port in self.members]
        config = RouterConfig(port=0, model_name=MODEL_NAME, disaggregation="always")
        self.running = serve_router(config, engine, addresses[:1], addresses[1:], secret=SECRET)

    @property
    def url(self) -> str:
        return f"{self.running.url}/v1/completions"

    def stop(self) -> None:
        self.running.stop()
        for instance, server, _ in self.members:
            server.stop(0).wait()
            instance.stop()


def complete(url: str, prompt: list[int]) -> tuple[int, str, float]:
    """(status, text, seconds) of one greedy completion."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    start = time.perf_counter()
    reply = httpx.post(url, json=body, timeout=120)
    elapsed = time.perf_counter() - start
    text = reply.json()["choices"][0]["text"] if reply.status_code == 200 else ""
    return reply.status_code, text, elapsed


def run(transport: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    hook = StallNext()
    cluster = Cluster(transport, args.stall_timeout_s, hook)
    failed = wrong = 0
    added: list[float] = []
    try:
        complete(cluster.url, prompts[-1][::-1])  # warm-up
        for prompt in prompts:
            status, clean_text, clean_s = complete(cluster.url, prompt)
            hook.arm()
            stalled_status, text, stalled_s = complete(cluster.url, prompt)
            hook.release()
            failed += (status != 200) + (stalled_status != 200)
            wrong += text != clean_text
            added.append(stalled_s - clean_s)
    finally:
        hook.release()
        cluster.stop()
    failover = [retried - stalled for stalled, retried in hook.episodes]
    if len(failover) != len(prompts):
        logger.warning("%s: %d of %d stalls were retried", transport, len(failover), len(prompts))
    return {
        "transport": transport,
        "requests": len(prompts),
        "failed": failed,
        "wrong_texts": wrong,
        "stalls_retried": len(failover),
        "failover_p50_s": float(np.percentile(failover, 50)) if failover else float("nan"),
        "failover_p99_s": float(np.percentile(failover, 99)) if failover else float("nan"),
        "added_latency_median_s": float(np.median(added)),
    }


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    logging.basicConfig(level=logging.WARNING)
    count = args.requests or (4 if args.quick else 20)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(32, 120, PROMPT_TOKENS)] for _ in range(count)]
    runs = [run(transport, args, prompts) for transport in TRANSPORTS]
    print_table(
        f"Stalled transfers (stall_timeout_s {args.stall_timeout_s:g}, {count} per transport)",
        ["transport", "failed", "wrong", "retried", "failover p50 s", "p99 s", "added s"],
        [
            [r["transport"], r["failed"], r["wrong_texts"], r["stalls_retried"],
             r["failover_p50_s"], r["failover_p99_s"], r["added_latency_median_s"]]
            for r in runs
        ],
    )  # fmt: skip
    metrics: dict[str, float] = {
        "stall_timeout_s": args.stall_timeout_s,
        "failed": sum(r["failed"] for r in runs),
        "wrong_texts": sum(r["wrong_texts"] for r in runs),
        **{f"failover_p99_s_{r['transport']}": r["failover_p99_s"] for r in runs},
    }
    finish(NAME, args, {"runs": runs}, metrics)


if __name__ == "__main__":
    main()

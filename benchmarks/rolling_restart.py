"""Rolling restart of every decode instance under load: moved KV against recomputed context.

    python benchmarks/rolling_restart.py [--quick] [--streams 48] [--max-tokens 1000]

An in-process cluster (built-in tiny model, 1 prefill + 3 decode instances, a router on the
OpenAI API; no storage tier) serves `--streams` greedy streams of `--max-tokens` tokens (distinct
64-token prompts, `ignore_eos`), all started together. Once every stream has `--roll-after`
tokens, each decode instance in turn is replaced as an upgrade replaces it: a new decode
instance joins, the old one is drained, and it is stopped once no request holds it. Three runs
on fresh clusters:

  * `fault_free`: no roll (the reference texts);
  * `move` (`router.drain_moves_streams: true`, the default): the drained instance's streams
    move to the others, each at a block boundary of its context, which the prefill instance
    reads back from the drained instance instead of computing;
  * `recompute` (how drains ended before moves existed): the old instance is stopped as soon as
    the new one serves; its streams break and continue elsewhere, their context computed again.

Per run: failed requests, texts differing from `fault_free`'s, the moved context (prompt tokens
the prefill instance admitted during the roll: every one is a continuation) and the part of it
recomputed (tokens the prefill instance computed during the roll), the roll's duration, and the
inter-token latency p99 from the roll's start until `SETTLE_S` after its end (streams broken by
a stop resume after it) against as long a stretch before it (client side, every stream's
gaps).

RESULT: `failed_move`, `wrong_texts_move`, `recomputed_fraction_move` (target <= 0.01),
`recomputed_fraction_recompute`, `itl_p99_roll_vs_before_move` and `..._recompute`, `roll_s_move`.
"""

import argparse
import asyncio
import json
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import torch
from _common import finish, parse_args, print_table

from pdserve.config import DecodeConfig, EngineConfig, PrefillConfig, RouterConfig
from pdserve.rpc.auth import new_secret
from pdserve.rpc.channels import ChannelPool
from pdserve.v1 import common_pb2, common_pb2_grpc

NAME = "rolling_restart"
MODEL_NAME = "tiny"
SECRET = new_secret()
PROMPT_TOKENS = 64
MODES = ("fault_free", "move", "recompute")
SETTLE_S = 5.0  # after the roll: the broken streams' continuations are computed then

logger = logging.getLogger(NAME)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, help="concurrent streams (48; quick 12)")
    parser.add_argument("--max-tokens", type=int, help="tokens per stream (1000; quick 300)")
    parser.add_argument(
        "--roll-after", type=int, help="tokens every stream has first (half of --max-tokens)"
    )
    parser.add_argument("--decode-kv-blocks", type=int, default=4096)
    parser.add_argument("--verbose", action="store_true", help="INFO logs of the services")


@dataclass
class Stream:
    prompt: list[int]
    times: list[float] = field(default_factory=list)  # each token chunk's arrival (monotonic)
    text: str = ""
    tokens: int = 0
    error: str | None = None


@dataclass
class Member:
    instance: Any
    server: Any
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(0).wait()
        self.instance.stop()


class Cluster:
    """1 prefill + 3 decode instances and a router, in this process."""

    def __init__(self, args: argparse.Namespace, moves: bool) -> None:
        from services.decode.servicer import serve_decode
        from services.prefill.servicer import serve_prefill
        from services.router.server import serve_router

        common: dict[str, Any] = {"model": None, "torch_threads": 1, "max_model_len": 2048}
        self.prefill_engine = EngineConfig(num_kv_blocks=8192, **common)
        self.decode_engine = EngineConfig(num_kv_blocks=args.decode_kv_blocks, **common)
        self._serve_decode = serve_decode
        self.prefill = Member(*serve_prefill(self.prefill_engine, PrefillConfig(), secret=SECRET))
        self.decodes = [self._new_decode() for _ in range(3)]
        config = RouterConfig(
            port=0, model_name=MODEL_NAME, disaggregation="always", drain_moves_streams=moves
        )
        self.running = serve_router(
            config, self.prefill_engine, [self.prefill.address],
            [d.address for d in self.decodes], secret=SECRET,
        )  # fmt: skip

    def _new_decode(self) -> Member:
        return Member(*self._serve_decode(self.decode_engine, DecodeConfig(), secret=SECRET))

    @property
    def url(self) -> str:
        return f"{self.running.url}/v1/completions"

    def replace(self, old: Member, wait: bool) -> Member:
        """A new decode instance joins; `old` is drained, then (`wait`: once nothing holds
        it) taken out of routing and stopped."""
        router = self.running.router
        new = self._new_decode()
        router.add_instance("decode", new.address)
        router.membership.set_drained(old.address, True)
        if wait and not router.wait_idle(old.address, 120):
            raise RuntimeError(f"{old.address} still holds requests after 120 s")
        router.remove_instance(old.address)
        old.stop()
        return new

    def stop(self) -> None:
        self.running.stop()
        for member in [self.prefill, *self.decodes]:
            member.stop()


def prefill_counters(address: str) -> tuple[int, int, int]:
    """(prompt tokens admitted, computed, pulled) of the prefill instance."""
    pool = ChannelPool(SECRET)
    try:
        stub = common_pb2_grpc.InstanceServiceStub(pool.get(address))
        s = stub.GetStats(common_pb2.StatsRequest(), timeout=10)
        return int(s.prefix_cache_queries), int(s.num_computed_tokens), int(s.peer_hit_tokens)
    finally:
        pool.close()


async def stream_one(http: httpx.AsyncClient, url: str, stream: Stream, max_tokens: int) -> None:
    body = {"model": MODEL_NAME, "prompt": stream.prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    texts = []
    try:
        async with http.stream("POST", url, json=body) as reply:
            if reply.status_code != 200:
                stream.error = f"HTTP {reply.status_code}"
                return
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    stream.error = str(chunk["error"].get("message"))[:200]
                    return
                for choice in chunk.get("choices", []):
                    if choice.get("text"):
                        texts.append(choice["text"])
                        stream.times.append(time.monotonic())
                        stream.tokens += 1
    except httpx.HTTPError as e:
        stream.error = f"{type(e).__name__}: {e}"[:200]
    stream.text = "".join(texts)


def run(mode: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    cluster = Cluster(args, moves=mode != "recompute")
    streams = [Stream(p) for p in prompts]
    roll: dict[str, Any] = {}
    try:
        done = threading.Event()

        def load() -> None:
            async def main() -> None:
                limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
                async with httpx.AsyncClient(timeout=600, limits=limits) as http:
                    await asyncio.gather(
                        *(stream_one(http, cluster.url, s, args.max_tokens) for s in streams)
                    )

            asyncio.run(main())
            done.set()

        thread = threading.Thread(target=load)
        thread.start()
        if mode != "fault_free":
            while min(s.tokens for s in streams) < args.roll_after and not done.is_set():
                time.sleep(0.05)
            before = prefill_counters(cluster.prefill.address)
            started = time.monotonic()
            for index, old in enumerate(list(cluster.decodes)):
                cluster.decodes[index] = cluster.replace(old, wait=mode == "move")
            ended = time.monotonic()
            after = prefill_counters(cluster.prefill.address)
            roll = {"started": started, "ended": ended, "before": before, "after": after}
            if done.is_set():
                logger.warning("the streams ended before the roll did: raise --max-tokens")
        thread.join()
    finally:
        cluster.stop()
    return summarize(streams, roll)


def summarize(streams: list[Stream], roll: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {
        "failed": sum(s.error is not None for s in streams),
        "errors": [s.error for s in streams if s.error is not None][:5],
        "texts": [s.text for s in streams],
    }
    if not roll:
        return result
    started, ended = roll["started"], roll["ended"]
    duration = ended - started

    def gaps(lo: float, hi: float) -> list[float]:
        return [1e3 * (b - a) for s in streams for a, b in zip(s.times, s.times[1:], strict=False)
                if lo <= b < hi]  # fmt: skip

    window = duration + SETTLE_S
    during, earlier = gaps(started, started + window), gaps(started - window, started)
    (q0, c0, p0), (q1, c1, p1) = roll["before"], roll["after"]
    moved, recomputed = q1 - q0, c1 - c0
    result.update(
        roll_s=duration,
        moved_context_tokens=moved,
        recomputed_tokens=recomputed,
        pulled_tokens=p1 - p0,
        recomputed_fraction=recomputed / moved if moved else float("nan"),
        itl_p99_before_ms=float(np.percentile(earlier, 99)) if earlier else float("nan"),
        itl_p99_roll_ms=float(np.percentile(during, 99)) if during else float("nan"),
    )
    result["itl_p99_roll_vs_before"] = result["itl_p99_roll_ms"] / result["itl_p99_before_ms"]
    return result


def first_difference(a: str, b: str) -> int:
    """Where two texts first differ."""
    differing = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(differing, min(len(a), len(b)))


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    torch.set_num_threads(1)
    args.streams = args.streams or (12 if args.quick else 48)
    args.max_tokens = args.max_tokens or (300 if args.quick else 1000)
    args.roll_after = args.roll_after or args.max_tokens // 2
    rng = random.Random(0)
    prompts = [[rng.randrange(16, 246) for _ in range(PROMPT_TOKENS)] for _ in range(args.streams)]
    runs = {}
    for mode in MODES:
        print(f"running {mode} ...", flush=True)
        runs[mode] = run(mode, args, prompts)
    reference = runs["fault_free"]["texts"]
    for mode in MODES:
        texts = runs[mode].pop("texts")
        wrong = [(i, first_difference(a, b)) for i, (a, b) in enumerate(zip(texts, reference,
                 strict=True)) if a != b]  # fmt: skip
        runs[mode]["wrong_texts"] = len(wrong)
        runs[mode]["first_differences"] = wrong  # (stream, character) of each wrong text
    rows = [
        [mode, r["failed"], r["wrong_texts"], r.get("moved_context_tokens", 0),
         r.get("recomputed_tokens", 0), r.get("recomputed_fraction", 0.0), r.get("roll_s", 0.0),
         r.get("itl_p99_before_ms", 0.0), r.get("itl_p99_roll_ms", 0.0)]
        for mode, r in runs.items()
    ]  # fmt: skip
    headers = ["run", "failed", "wrong texts", "moved ctx", "recomputed", "fraction", "roll s",
               "ITL p99 before ms", "ITL p99 roll ms"]  # fmt: skip
    print_table(
        f"rolling restart: {args.streams} streams x {args.max_tokens} tokens", headers, rows
    )
    move, recompute = runs["move"], runs["recompute"]
    metrics = {
        "failed_move": move["failed"],
        "wrong_texts_move": move["wrong_texts"],
        "recomputed_fraction_move": move["recomputed_fraction"],
        "recomputed_fraction_recompute": recompute["recomputed_fraction"],
        "itl_p99_roll_vs_before_move": move["itl_p99_roll_vs_before"],
        "itl_p99_roll_vs_before_recompute": recompute["itl_p99_roll_vs_before"],
        "roll_s_move": move["roll_s"],
        "failed_recompute": recompute["failed"],
        "wrong_texts_recompute": recompute["wrong_texts"],
    }
    finish(NAME, args, {"runs": runs}, metrics)


if __name__ == "__main__":
    main()

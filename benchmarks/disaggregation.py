"""Conditional disaggregation live: TTFT by prompt length with `router.disaggregation: always`
against `auto`, on the same workload, alternated.

    python benchmarks/disaggregation.py [--quick]

Each side is a fresh `pdserve up` (its own local Ray; one prefill and one decode instance, the
built-in tiny model, torch threads 1 each) that only `router.disaggregation` tells apart; the
sides alternate `--rounds` times (2; quick 1). The workload, identical for both: `--seconds`
(60; quick 20) of open-loop Poisson arrivals at `--rate` requests/s (3), each a streamed
`/v1/completions` of random token ids, greedy, 32 output tokens:

- `short`: 16–64 new tokens;
- `long`: 1,024–2,048 new tokens;
- `turn`: a follow-up of one of 8 conversations: its previous prompt and answer plus 16–64 new
  tokens (mostly cached, on whichever instance computed the previous turn).

TTFT is measured at the client (request sent -> first token); ITL as every gap between a
request's streamed chunks, all kinds together (what computing prompts on the decode instance
costs the requests decoding there). Reported per kind and side: p50 and p90 TTFT, p50 and p90
ITL, and the ratio auto ÷ always of each (median over rounds); the paths auto took
(`pdserve_router_disaggregation_total`). Target (issue's acceptance): short and turn prompts
lower with auto, long ones no worse (ratio <= 1.05 within the machine's noise).

Prints a table, writes benchmarks/results/disaggregation.json, ends with one RESULT line.
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from _common import finish, parse_args, print_table
from _online import PdserveCluster

from pdserve.model.tiny import default_model_dir

NAME = "disaggregation"
KINDS = ("short", "long", "turn")
ROOT = Path(__file__).resolve().parent.parent


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=None, help="load per side (60; 20)")
    parser.add_argument("--rounds", type=int, default=None, help="alternations (2; quick 1)")
    parser.add_argument("--rate", type=float, default=3.0, help="requests/s")
    parser.add_argument("--seed", type=int, default=0)


def cluster(mode: str) -> PdserveCluster:
    config = {
        "engine": {"model": str(default_model_dir()), "torch_threads": 1, "num_kv_blocks": 2048},
        "prefill": {"num_cpus": 0.5},
        "decode": {"num_cpus": 0.5},
        "router": {"disaggregation": mode, "stats_interval_s": 0.2, "model_name": "tiny"},
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return PdserveCluster(f"disagg-{mode}", config, env, start_timeout_s=300, root=ROOT)


class Workload:
    """The same requests for every side (seeded), conversations growing as they answer."""

    def __init__(self, seed: int, vocab: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.conversations = [self.tokens(96) for _ in range(8)]

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def next(self) -> tuple[str, int, list[int]]:
        kind = self.rng.choice(KINDS)
        if kind == "short":
            return kind, -1, self.tokens(self.rng.randint(16, 64))
        if kind == "long":
            return kind, -1, self.tokens(self.rng.randint(1024, 2048))
        which = self.rng.randrange(len(self.conversations))
        history = self.conversations[which]
        if len(history) > 3000:  # the context window: start the conversation again
            history = self.conversations[which] = self.tokens(96)
        return kind, which, history + self.tokens(self.rng.randint(16, 64))


async def run_side(url: str, args: argparse.Namespace, seconds: float) -> dict[str, list[float]]:
    """TTFT (s) per kind over one side's load, and every gap between streamed chunks (`itl`)."""
    workload = Workload(args.seed, vocab=256)
    rng = random.Random(args.seed + 1)
    ttft: dict[str, list[float]] = {kind: [] for kind in (*KINDS, "itl")}
    tasks = []
    async with httpx.AsyncClient(timeout=300) as client:

        async def one(kind: str, which: int, prompt: list[int]) -> None:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 32, "temperature": 0,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            sent = time.perf_counter()
            first, last, answer = None, None, []
            endpoint = f"{url.removesuffix('/v1')}/v1/completions"
            async with client.stream("POST", endpoint, json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"{response.status_code}: {await response.aread()!r}")
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        now = time.perf_counter()
                        if last is not None:
                            ttft["itl"].append(now - last)
                        first, last = first or now, now
                        answer.extend(json.loads(line[6:]).get("choices", [{}])[0].get("text", ""))
            if first is not None:
                ttft[kind].append(first - sent)
            if which >= 0:  # the conversation goes on with this answer (bytes of the text)
                tail = [min(255, ord(c)) for c in answer]
                workload.conversations[which] = prompt + tail

        started = time.perf_counter()
        at = started
        while at - started < seconds:
            at += rng.expovariate(args.rate)
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tasks.append(asyncio.ensure_future(one(*workload.next())))
        await asyncio.gather(*tasks)
    return ttft


def paths(url: str) -> dict[str, float]:
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    found = {}
    for line in text.splitlines():
        if line.startswith("pdserve_router_disaggregation_total{"):
            name, value = line.rsplit(" ", 1)
            found[name.split('"')[1]] = float(value)
    return found


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    seconds = args.seconds or (20.0 if args.quick else 60.0)
    rounds = args.rounds or (1 if args.quick else 2)
    samples: dict[str, list[dict[str, Any]]] = {"always": [], "auto": []}
    for round_index in range(rounds):
        order = ("always", "auto") if round_index % 2 == 0 else ("auto", "always")
        for mode in order:
            side = cluster(mode)
            side.start()
            try:
                ttft = asyncio.run(run_side(side.url, args, seconds))
                samples[mode].append({"ttft": ttft, "paths": paths(side.url)})
            finally:
                side.stop()
    figures = summarise(samples)
    report(figures, seconds, rounds)
    metrics = {f"{kind}_{q}_ratio": figures[kind][f"{q}_ratio"] for kind in (*KINDS, "itl")
               for q in ("p50", "p90")}  # fmt: skip
    finish(NAME, args, {"figures": figures, "samples": compact(samples)}, metrics)


def compact(samples: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """The samples for the JSON: every TTFT, but the thousands of ITL gaps as percentiles."""
    kept: dict[str, list[dict[str, Any]]] = {}
    for mode, rounds in samples.items():
        kept[mode] = []
        for sample in rounds:
            gaps = sample["ttft"]["itl"]
            ttft = {kind: values for kind, values in sample["ttft"].items() if kind != "itl"}
            itl = {"gaps": len(gaps), **{f"p{q}_s": percentile(gaps, q / 100)
                                         for q in (50, 90, 99)}}  # fmt: skip
            kept[mode].append({**sample, "ttft": ttft, "itl": itl})
    return kept


def summarise(samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for kind in (*KINDS, "itl"):
        entry: dict[str, float] = {}
        for q, level in (("p50", 0.5), ("p90", 0.9)):
            per_round = {
                mode: [percentile(s["ttft"][kind], level) for s in samples[mode]]
                for mode in samples
            }
            entry[f"always_{q}_ms"] = 1000 * statistics.median(per_round["always"])
            entry[f"auto_{q}_ms"] = 1000 * statistics.median(per_round["auto"])
            entry[f"{q}_ratio"] = statistics.median(
                a / b for a, b in zip(per_round["auto"], per_round["always"], strict=True)
            )
        entry["requests"] = sum(len(s["ttft"][kind]) for s in samples["auto"])
        figures[kind] = entry
    figures["auto_paths"] = samples["auto"][-1]["paths"]
    return figures


def report(figures: dict[str, Any], seconds: float, rounds: int) -> None:
    rows = [
        [kind if kind in KINDS else "ITL (all)", f["always_p50_ms"], f["auto_p50_ms"],
         f["p50_ratio"], f["always_p90_ms"], f["auto_p90_ms"], f["p90_ratio"]]
        for kind in (*KINDS, "itl")
        for f in (figures[kind],)
    ]  # fmt: skip
    print_table(
        f"TTFT (ms) by prompt kind and ITL, 1 prefill + 1 decode, {seconds:g} s per side, "
        f"{rounds} round(s), median over rounds",
        ["kind", "always p50", "auto p50", "auto/always", "always p90", "auto p90", "auto/always"],
        rows,
    )
    print(f"\npaths auto took (last round): {figures['auto_paths']}")


if __name__ == "__main__":
    main()

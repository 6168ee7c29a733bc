"""oneDNN's kernel caches on CPU: pdserve's cap (`engine.onednn_cache_entries`) against torch's
default (1024 entries), on batches of varied shapes.

    python benchmarks/kernel_cache.py [--quick] [--repeat N] [--batches N]

oneDNN compiles a matrix kernel for each weight shape and number of batch rows and keeps it in
two caches (its own and ideep's), each 1024 entries by default and read once per process. Each
side runs in a process of its own: an `LLMEngine` on the built-in tiny model generates `--batches`
batches of 1-8 greedy requests whose prompts have 8-400 random tokens (16 tokens each, EOS
ignored), after 20 batches of warm-up. A round runs both sides on the same batches (same seed),
in alternating order. Per side: tokens (prompt + generated) per second, and how much the
process's malloc heap grew during the timed batches (glibc's `mallinfo2`: bytes in use).

RESULT: `ratio` = capped tok/s ÷ default tok/s (median of the rounds' ratios), `heap_default_mb`,
`heap_capped_mb` (medians), `entries` (the cap).
"""

import argparse
import ctypes
import gc
import json
import random
import subprocess
import sys
import time

from _common import finish, median, parse_args, print_table, repeats

NAME = "kernel_cache"
TORCH_DEFAULT = 1024
MAX_TOKENS = 16


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def heap_in_use_mb() -> float:
    gc.collect()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return float(libc.mallinfo2().uordblks) / 2**20


def side(entries: int, seed: int, batches: int) -> dict[str, float]:
    """One side, in this process: tok/s and heap growth over `batches` timed batches."""
    from pdserve.config import EngineConfig
    from pdserve.engine import LLMEngine, SamplingParams

    engine = LLMEngine.from_config(EngineConfig(onednn_cache_entries=entries))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    rng = random.Random(seed)

    def batch() -> list[list[int]]:
        sizes = [rng.randrange(8, 400) for _ in range(rng.randrange(1, 9))]
        return [[rng.randrange(3, 200) for _ in range(n)] for n in sizes]

    for _ in range(20):
        engine.generate(batch(), params)
    before, tokens, start = heap_in_use_mb(), 0, time.perf_counter()
    for _ in range(batches):
        prompts = batch()
        tokens += sum(map(len, prompts)) + MAX_TOKENS * len(prompts)
        engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    return {"tok_s": tokens / seconds, "heap_mb": heap_in_use_mb() - before}


def run_side(entries: int, seed: int, batches: int) -> dict[str, float]:
    command = [sys.executable, __file__, "--side", str(entries), str(seed), str(batches)]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    result: dict[str, float] = json.loads(output.strip().splitlines()[-1])
    return result


def main() -> None:
    if sys.argv[1:2] == ["--side"]:
        entries, seed, batches = map(int, sys.argv[2:5])
        print(json.dumps(side(entries, seed, batches)))
        return

    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--batches", type=int, default=None, help="150; --quick: 40")

    args = parse_args(__doc__ or NAME, configure)
    from pdserve.config import EngineConfig

    capped = EngineConfig().onednn_cache_entries
    batches = args.batches or (40 if args.quick else 150)
    rounds = []
    for n in range(repeats(args, 1, 3)):
        order = [TORCH_DEFAULT, capped] if n % 2 == 0 else [capped, TORCH_DEFAULT]
        sides = {entries: run_side(entries, n, batches) for entries in order}
        rounds.append({"default": sides[TORCH_DEFAULT], "capped": sides[capped]})
        print(f"round {n + 1}: {rounds[-1]}", flush=True)
    ratio = median([r["capped"]["tok_s"] / r["default"]["tok_s"] for r in rounds])
    heap = {k: median([r[k]["heap_mb"] for r in rounds]) for k in ("default", "capped")}
    speed = {k: median([r[k]["tok_s"] for r in rounds]) for k in ("default", "capped")}
    print_table(
        f"{batches} varied batches per side (tiny model), median of {len(rounds)} rounds",
        ["cache entries", "tok/s", "heap growth MB"],
        [
            [TORCH_DEFAULT, round(speed["default"]), round(heap["default"], 1)],
            [capped, round(speed["capped"]), round(heap["capped"], 1)],
        ],
    )
    metrics = {
        "ratio": round(ratio, 3),
        "heap_default_mb": round(heap["default"], 1),
        "heap_capped_mb": round(heap["capped"], 1),
        "entries": capped,
    }
    finish(NAME, args, {"rounds": rounds, "batches": batches}, metrics)


if __name__ == "__main__":
    main()

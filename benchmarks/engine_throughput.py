"""Engine decode throughput against a bare model loop on the same batches.

    python benchmarks/engine_throughput.py [--quick] [--threads N] [--steps N] [--batches 1,8,32]

For each batch size B, B requests with distinct prompts are added to an `LLMEngine` (built-in tiny
model); once their prefill step is done, only the decode steps are timed (tokens produced per
second). The "bare" loop runs the same model through `ModelRunner.execute` on the same prompts,
batch sizes, context lengths and number of steps, with fixed block tables and `torch.argmax`
instead of the scheduler, sampler and detokenizer. `ratio_bB` = engine tok/s ÷ bare tok/s (median
of per-round ratios; engine and bare steps alternate one by one); target >= 0.7 at batch 32.
"""

import argparse
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from _common import finish, median, parse_args, print_table, repeats

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import SamplingParams
from pdserve.model.runner import ModelRunner, SequenceChunk

NAME = "engine_throughput"
BLOCK_SIZE = 16
RATIO_TARGET = 0.7
TARGET_BATCH = 32


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads for engine and bare loop alike (default 1: on a shared 2-core "
        "box, 2 threads slow the forward down ~10x whenever another process holds a core)",
    )
    parser.add_argument("--batches", type=str, default="1,8,32", help="comma-separated sizes")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps (16 / 64)")


class Prompts:
    """Distinct, deterministic prompts; every call gives fresh ones (no prefix-cache hits)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self._serial = 0

    def take(self, count: int) -> list[list[int]]:
        prompts = []
        for _ in range(count):
            self._serial += 1
            seed = self._serial * 1_000_003
            prompts.append([32 + (seed + 7 * i * i + 13 * i) % 95 for i in range(self.length)])
        return prompts


class EngineDecoder:
    """The engine side: requests added and prefilled (untimed); `step` runs one decode step."""

    def __init__(self, engine: LLMEngine, prompts: Sequence[list[int]], steps: int) -> None:
        self.engine = engine
        self.produced = 0
        params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
        for prompt in prompts:
            engine.add_request(prompt, params)
        first_tokens = 0
        while first_tokens < len(prompts):  # prefill: each request samples its first token
            first_tokens += len(engine.step())

    def step(self) -> None:
        self.produced += len(self.engine.step())


class BareDecoder:
    """The same forward passes with fixed block tables and argmax feedback, no engine around."""

    def __init__(self, runner: ModelRunner, prompts: Sequence[list[int]], steps: int) -> None:
        self.runner = runner
        self.produced = 0
        blocks_per_seq = -(-(len(prompts[0]) + steps + 1) // BLOCK_SIZE)
        self.tables = [
            range(i * blocks_per_seq, (i + 1) * blocks_per_seq) for i in range(len(prompts))
        ]
        prefill = [SequenceChunk(p, 0, t, True) for p, t in zip(prompts, self.tables, strict=True)]
        self.tokens: list[int] = torch.argmax(runner.execute(prefill), dim=-1).tolist()
        self.positions = [len(p) for p in prompts]

    def step(self) -> None:
        chunks = [
            SequenceChunk((token,), pos, table, True)
            for token, pos, table in zip(self.tokens, self.positions, self.tables, strict=True)
        ]
        self.tokens = torch.argmax(self.runner.execute(chunks), dim=-1).tolist()
        self.positions = [pos + 1 for pos in self.positions]
        self.produced += len(self.tokens)


def lockstep_round(
    engine: LLMEngine, runner: ModelRunner, prompts: Sequence[list[int]], steps: int
) -> tuple[float, float]:
    """Engine and bare tok/s over `steps` decode steps of the same batch, run one step each in
    turn (the order flipping every step) so that both see the same machine load."""
    sides = (EngineDecoder(engine, prompts, steps), BareDecoder(runner, prompts, steps))
    seconds = [0.0, 0.0]
    for i in range(steps):
        for side in (0, 1) if i % 2 == 0 else (1, 0):
            start = time.perf_counter()
            sides[side].step()
            seconds[side] += time.perf_counter() - start
    expected = steps * len(prompts)
    if engine.has_unfinished_requests() or sides[0].produced != expected:
        raise RuntimeError(f"engine produced {sides[0].produced} tokens, expected {expected}")
    return sides[0].produced / seconds[0], sides[1].produced / seconds[1]


@dataclass(frozen=True, slots=True)
class BatchFigures:
    engine_tok_s: float  # medians over rounds
    bare_tok_s: float
    ratio: float  # median of per-round engine / bare
    engine_samples: list[float]
    bare_samples: list[float]
    ratios: list[float]
    engine_step_ms: float
    bare_step_ms: float


def batch_figures(batch: int, engine: list[float], bare: list[float]) -> BatchFigures:
    """One batch size's figures from its rounds' tok/s, engine and bare runner."""
    ratios = [e / b for e, b in zip(engine, bare, strict=True)]
    engine_tps, bare_tps = median(engine), median(bare)
    return BatchFigures(
        engine_tps,
        bare_tps,
        median(ratios),
        engine,
        bare,
        ratios,
        1e3 * batch / engine_tps,
        1e3 * batch / bare_tps,
    )


def make_engine_and_runner(
    args: argparse.Namespace, max_batch: int, steps: int
) -> tuple[LLMEngine, ModelRunner]:
    """The engine, and a bare runner on the same weights, each with room for `max_batch`
    sequences of the prompt plus `steps` tokens."""
    blocks_per_seq = -(-(args.prompt_len + steps + 1) // BLOCK_SIZE)
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        num_kv_blocks=2 * max_batch * blocks_per_seq + 16,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(512, max_batch * args.prompt_len),
        torch_threads=args.threads,
    )
    engine = LLMEngine.from_config(config)
    loaded = engine.loaded
    runner = ModelRunner.create(loaded.model, max_batch * blocks_per_seq, BLOCK_SIZE, loaded.dtype)
    return engine, runner


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    batches = [int(b) for b in args.batches.split(",")]
    steps = args.steps or (16 if args.quick else 64)
    repeat = repeats(args, quick=3, full=5)
    torch.set_num_threads(args.threads)

    engine, runner = make_engine_and_runner(args, max(batches), steps)
    prompts = Prompts(args.prompt_len)

    rows: list[list[str | int | float]] = []
    per_batch: dict[str, dict[str, object]] = {}
    metrics: dict[str, float] = {}
    for batch in batches:
        lockstep_round(engine, runner, prompts.take(batch), steps)  # warm-up
        rounds = [lockstep_round(engine, runner, prompts.take(batch), steps) for _ in range(repeat)]
        f = batch_figures(batch, [e for e, _ in rounds], [b for _, b in rounds])
        per_batch[str(batch)] = asdict(f)
        overhead_ms = 1e3 * batch * (1 / f.engine_tok_s - 1 / f.bare_tok_s)
        rows.append([batch, f.engine_tok_s, f.bare_tok_s, f.ratio, overhead_ms])
        metrics[f"ratio_b{batch}"] = f.ratio

    print_table(
        f"decode tok/s, tiny model, {args.threads} threads, prompt {args.prompt_len}, "
        f"{steps} steps, median of {repeat}",
        ["batch", "engine tok/s", "bare tok/s", "ratio", "overhead ms/step"],
        rows,
    )
    verdict = "n/a"
    if TARGET_BATCH in batches:
        ok = metrics[f"ratio_b{TARGET_BATCH}"] >= RATIO_TARGET
        verdict = "PASS" if ok else "FAIL"
        print(f"\nratio at batch {TARGET_BATCH}: target >= {RATIO_TARGET} -> {verdict}")
    results = {
        "batches": per_batch,
        "steps": steps,
        "prompt_len": args.prompt_len,
        "threads": args.threads,
        "repeat": repeat,
        "ratio_target": RATIO_TARGET,
        "target_batch": TARGET_BATCH,
        "verdict": verdict,
    }
    finish(NAME, args, results, metrics)


if __name__ == "__main__":
    main()

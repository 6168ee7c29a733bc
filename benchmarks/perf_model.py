"""How well an engine's step time model predicts its steps under a mixed load.

    python benchmarks/perf_model.py [--quick]

For the tiny model and a ~156M-parameter random Llama (`vs_vllm.py`'s `big` model, 8 layers),
each on `--threads` torch threads: the start's profiling pass (`pdserve.engine.profiling`,
budget `--profile-s`, 10 s; its time is reported), then `--seconds` of a mixed load driven
through `LLMEngine.step` the way an instance drives it: requests arrive as a Poisson process
(rate chosen so that ~`--concurrency` run at once), prompts of random tokens either short
(16–128) or long (256–`--long`), a third of them behind one of four shared 96-token prefixes
(prefix-cache reads), outputs of 4–96 tokens. Every step's prediction is made by the live
model before the step runs, the way it serves (`StepTimeModel.observe` scores it):
`median_error` and `p90_error` are |predicted - measured| / measured over the load's steps.

The features are justified by their residuals: on the same recorded steps, least squares on
the first half and the relative error on the second half, for the full feature set and for
the sets without each attention feature and without both (`ablation`).

Prints a table per model, writes benchmarks/results/perf_model.json, ends with one RESULT line.
Target: median_error <= 0.15 on both models.
"""

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import finish, parse_args, print_table
from vs_vllm import big_model_dir

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.perf_model import FEATURES, StepShape
from pdserve.engine.profiling import profile
from pdserve.engine.request import SamplingParams
from pdserve.model.tiny import default_model_dir

NAME = "perf_model"
TARGET = 0.15
ABLATIONS = {
    "all features": FEATURES,
    "no prefill_attention": tuple(f for f in FEATURES if f != "prefill_attention"),
    "no decode_context": tuple(f for f in FEATURES if f != "decode_context"),
    "no attention features": ("constant", "prefill_tokens", "decode_rows"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=None, help="load per model (60; 15)")
    parser.add_argument("--profile-s", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=24, help="requests running at once")
    parser.add_argument("--long", type=int, default=1024, help="longest prompt")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--big-layers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="the load's random stream")


class Recorder:
    """Wraps the engine's model: each step's shape, prediction and time, before it learns."""

    def __init__(self, engine: LLMEngine) -> None:
        self.steps: list[tuple[StepShape, float, float]] = []
        model = engine.step_time
        learn = model.observe

        def observe(shape: StepShape, seconds: float) -> None:
            self.steps.append((shape, model.predict(shape), seconds))
            learn(shape, seconds)

        model.observe = observe  # type: ignore[method-assign]


def run_load(engine: LLMEngine, args: argparse.Namespace, seconds: float) -> dict[str, float]:
    """Drive the mixed load for `seconds`; returns request counts."""
    rng = random.Random(args.seed)
    vocab = engine.loaded.config.vocab_size
    prefixes = [[rng.randrange(vocab) for _ in range(96)] for _ in range(4)]
    longest = min(args.long, engine.max_model_len - 100)
    mean_output = 50
    step_guess = 0.01 + 0.0005 * args.concurrency  # refined from the engine's own steps below
    started = time.perf_counter()
    next_arrival, submitted = started, 0
    while time.perf_counter() - started < seconds:
        now = time.perf_counter()
        running = engine.scheduler.running
        if running and engine.scheduler.stats.num_steps:
            step_guess = engine.scheduler.stats.step_seconds / engine.scheduler.stats.num_steps
        rate = args.concurrency / (mean_output * step_guess)  # arrivals/s keeping ~concurrency
        while next_arrival <= now:
            engine.add_request(prompt(rng, vocab, prefixes, longest), sampling(rng))
            submitted += 1
            next_arrival += rng.expovariate(rate)
        if engine.has_unfinished_requests():
            engine.step()
        else:
            time.sleep(max(0.0, min(next_arrival - time.perf_counter(), 0.01)))
    return {"requests": submitted}  # the engine is dropped with what still runs


def prompt(rng: random.Random, vocab: int, prefixes: list[list[int]], longest: int) -> list[int]:
    length = rng.randint(16, 128) if rng.random() < 0.6 else rng.randint(256, longest)
    tokens = [rng.randrange(vocab) for _ in range(length)]
    return rng.choice(prefixes) + tokens if rng.random() < 1 / 3 else tokens


def sampling(rng: random.Random) -> SamplingParams:
    return SamplingParams(max_tokens=rng.randint(4, 96), ignore_eos=True)


def ablation(steps: list[tuple[StepShape, float, float]]) -> dict[str, float]:
    """Median relative error on the second half of the least-squares fit on the first, per
    feature set."""
    x = np.asarray([shape.features() for shape, _, _ in steps])
    y = np.asarray([seconds for _, _, seconds in steps])
    half = len(steps) // 2
    errors = {}
    for name, features in ABLATIONS.items():
        columns = [FEATURES.index(f) for f in features]
        coefficients, *_ = np.linalg.lstsq(x[:half, columns], y[:half], rcond=None)
        predicted = x[half:, columns] @ coefficients
        errors[name] = float(np.median(np.abs(predicted - y[half:]) / y[half:]))
    return errors


def bench_model(label: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    engine = LLMEngine.from_config(
        EngineConfig(
            model=str(model_dir),
            num_kv_blocks=4096,
            max_model_len=2048,
            max_num_seqs=64,
            max_num_batched_tokens=512,
        )
    )
    started = time.perf_counter()
    profiled = profile(engine, args.profile_s)
    profile_s = time.perf_counter() - started
    recorder = Recorder(engine)
    seconds = args.seconds or (15.0 if args.quick else 60.0)
    load = run_load(engine, args, seconds)
    scored = [abs(p - s) / s for _, p, s in recorder.steps if s > 0]
    fit = engine.step_time.named_coefficients()
    result = {
        "profile_s": profile_s,
        "profile_steps": profiled,
        "steps": len(scored),
        **load,
        "median_error": statistics.median(scored),
        "p90_error": float(np.percentile(scored, 90)),
        "median_step_ms": 1000 * statistics.median(s for _, _, s in recorder.steps),
        "coefficients": fit,
        "ablation": ablation(recorder.steps),
    }
    print_table(
        f"{label}: {result['steps']} steps of a mixed load ({load['requests']} requests, "
        f"{seconds:g} s), after a {profile_s:.1f} s profiling pass ({profiled} steps)",
        ["features", "median |error|", "note"],
        [["online model", result["median_error"], f"p90 {result['p90_error']:.3f}, as served"]]
        + [
            [name, error, "fit on the first half, scored on the second"]
            for name, error in result["ablation"].items()
        ],
    )
    return result


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    torch.set_num_threads(args.threads)
    results = {
        "tiny": bench_model("tiny model", default_model_dir(), args),
        "big": bench_model(
            f"~156M Llama, {args.big_layers} layers", big_model_dir(args.big_layers), args
        ),
    }
    metrics = {
        f"{label}_{key}": results[label][key]
        for label in results
        for key in ("median_error", "p90_error", "profile_s")
    }
    verdict = all(results[label]["median_error"] <= TARGET for label in results)
    print(f"\nmedian |error| <= {TARGET}: {'PASS' if verdict else 'FAIL'}")
    finish(NAME, args, {**results, "target": TARGET, "pass": verdict}, metrics)


if __name__ == "__main__":
    main()

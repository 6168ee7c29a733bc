"""Engine decode throughput against a bare model loop on the same batches.

    python benchmarks/engine_throughput.py [--quick] [--threads N] [--steps N] [--batches 1,8,32]

For each batch size B, B requests with distinct prompts are added to an `LLMEngine` (built-in tiny
model); once their prefill step is done, only the decode steps are timed (tokens produced per
second). The "bare" loop runs the same model through `ModelRunner.execute` on the same prompts,
batch sizes, context lengths and number of steps, with fixed block tables and `torch.argmax`
instead of the scheduler, sampler and detokenizer. `ratio_bB` = engine tok/s ÷ bare tok/s (median
of per-round ratios; engine and bare steps alternate one by one); target >= 0.7 at batch 32.

    python benchmarks/engine_throughput.py --tp 2 [--quick] [--threads N] [--steps N]

With `--tp N` (N > 1) the two sides are instead a TP=1 engine and a TP=N engine (rank 0 in this
process, ranks 1..N-1 local worker processes, `engine.tensor_parallel_size`), on the same batches
and prompts, their decode steps alternating one by one as above: tok/s of both, `ratio_bB` =
TP=N tok/s ÷ TP=1 tok/s (median of per-round ratios), and the TP=N decode step split on rank 0:
ms per step in all, in collectives (rank 0's `TPGroup.stats` over the timed steps: the step
broadcast, the all-reduces, the logits gather, including any wait for a slower rank), the rest
(compute, scheduling, sampling) and collectives per step. Every rank runs `--threads` torch
threads. It writes `benchmarks/results/engine_throughput_tp.json` and ends with
`RESULT engine_throughput_tp ...`. On CPU the ranks are processes sharing the box's cores and
their collectives go through shared memory (`pdserve.model.shm_collectives`; gloo for tensors
beyond a slot): with `--threads 1` TP=2 runs on two cores where TP=1 runs on one, so the ratio
mixes that extra core with the collectives' cost — a device per rank is what TP is for.

Mixture of experts (after the tiny model's figures, unless `--skip-moe`): an engine on the random
Qwen3-MoE of vs_vllm.py (`moe_model_dir`: `--moe-layers` layers of hidden 1024, 32 experts of
width 512, top 4, written once), float32, `--threads` threads, at each of `--moe-batches`
(1,32,128): B requests prefilled (untimed), then `--moe-steps` decode steps timed one by one.
Forward hooks on every `SparseMoE` block (router + experts) and on its `Experts` add up the wall
time spent inside them (on CPU every op is synchronous, so a module call's wall time is its
work); `moe_share_bB` = the blocks' seconds ÷ the steps' seconds (median of `--repeat` rounds;
the experts' share alone in the JSON). On the last step of a round the `Experts` hooks also
keep every layer's inputs (hidden states, the ids and weights the router chose); after the last
round `Experts.forward` is timed alone on those (median of 5 samples), and `expert_us_per_tok_bB` =
that time ÷ B, per MoE layer, averaged over the layers (the model's total per token, the active
experts and rows per active expert in the JSON).
"""

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from _common import finish, median, median_seconds, parse_args, print_table, repeats

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import SamplingParams
from pdserve.engine.tensor_parallel import RankZero
from pdserve.model.moe import Experts, SparseMoE
from pdserve.model.parallel import CommStats
from pdserve.model.runner import ModelRunner, SequenceChunk

NAME = "engine_throughput"
TP_NAME = "engine_throughput_tp"
BLOCK_SIZE = 16
RATIO_TARGET = 0.7
TARGET_BATCH = 32
MOE_HEADERS = [
    *("batch", "tok/s", "ms/step", "MoE ms", "MoE share", "experts share"),
    *("expert µs/tok/layer", "µs/tok model", "active experts"),
]


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
    parser.add_argument(
        "--tp",
        type=int,
        default=None,
        help="compare a TP=1 engine with a TP=N one (N > 1, local worker processes) instead of "
        "the engine with the bare loop; writes engine_throughput_tp.json",
    )
    parser.add_argument("--skip-moe", action="store_true", help="no mixture-of-experts figures")
    parser.add_argument(
        "--moe-batches", type=str, default="1,32,128", help="comma-separated MoE decode batches"
    )
    parser.add_argument(
        "--moe-steps", type=int, default=None, help="timed MoE decode steps per round (4 / 16)"
    )
    parser.add_argument("--moe-layers", type=int, default=4, help="decoder layers of the MoE model")


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


class TPEngineDecoder(EngineDecoder):
    """`EngineDecoder` on rank 0 of a tensor-parallel engine, also summing the seconds and
    calls of its group's collectives over the steps it runs."""

    def __init__(self, engine: LLMEngine, prompts: Sequence[list[int]], steps: int) -> None:
        super().__init__(engine, prompts, steps)
        self.stats = tp_group_stats(engine)
        self.comm_seconds = 0.0
        self.comm_calls = 0

    def step(self) -> None:
        seconds, calls = self.stats.seconds, self.stats.calls
        super().step()
        self.comm_seconds += self.stats.seconds - seconds
        self.comm_calls += self.stats.calls - calls


def tp_group_stats(engine: LLMEngine) -> CommStats:
    tp = engine.runner.tp
    if not isinstance(tp, RankZero):
        raise RuntimeError("the engine is not rank 0 of a tensor-parallel instance")
    return tp.group.stats


def alternate(sides: Sequence[EngineDecoder | BareDecoder], steps: int) -> list[float]:
    """Seconds of each side over `steps` steps, run one step each in turn (the order flipping
    every step) so that all see the same machine load."""
    seconds = [0.0] * len(sides)
    for i in range(steps):
        order = range(len(sides)) if i % 2 == 0 else reversed(range(len(sides)))
        for side in order:
            start = time.perf_counter()
            sides[side].step()
            seconds[side] += time.perf_counter() - start
    return seconds


def check_produced(engine: LLMEngine, decoder: EngineDecoder, expected: int) -> None:
    if engine.has_unfinished_requests() or decoder.produced != expected:
        raise RuntimeError(f"engine produced {decoder.produced} tokens, expected {expected}")


def lockstep_round(
    engine: LLMEngine, runner: ModelRunner, prompts: Sequence[list[int]], steps: int
) -> tuple[float, float]:
    """Engine and bare tok/s over `steps` decode steps of the same batch, run one step each in
    turn (the order flipping every step) so that both see the same machine load."""
    sides = (EngineDecoder(engine, prompts, steps), BareDecoder(runner, prompts, steps))
    seconds = alternate(sides, steps)
    check_produced(engine, sides[0], steps * len(prompts))
    return sides[0].produced / seconds[0], sides[1].produced / seconds[1]


@dataclass(frozen=True, slots=True)
class TPRound:
    """One round of TP=1 against TP=N: tok/s of both, and TP=N's step split (ms per step)."""

    tp1_tok_s: float
    tpn_tok_s: float
    step_ms: float
    comm_ms: float
    collectives: float  # per step


def tp_round(
    single: LLMEngine, parallel: LLMEngine, prompts: Sequence[list[int]], steps: int
) -> TPRound:
    """The TP=1 and TP=N engines over `steps` decode steps of the same batch, alternating as
    `lockstep_round`'s sides do."""
    one, many = EngineDecoder(single, prompts, steps), TPEngineDecoder(parallel, prompts, steps)
    seconds = alternate((one, many), steps)
    for engine, decoder in ((single, one), (parallel, many)):
        check_produced(engine, decoder, steps * len(prompts))
    return TPRound(
        one.produced / seconds[0],
        many.produced / seconds[1],
        1e3 * seconds[1] / steps,
        1e3 * many.comm_seconds / steps,
        many.comm_calls / steps,
    )


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


def make_engine(
    args: argparse.Namespace, max_batch: int, steps: int, tensor_parallel_size: int = 1
) -> LLMEngine:
    """An engine with room for `max_batch` sequences of the prompt plus `steps` tokens (twice:
    the warm-up's and a round's requests may overlap); every rank uses `--threads` threads."""
    blocks_per_seq = -(-(args.prompt_len + steps + 1) // BLOCK_SIZE)
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        num_kv_blocks=2 * max_batch * blocks_per_seq + 16,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(512, max_batch * args.prompt_len),
        torch_threads=args.threads,
        tensor_parallel_size=tensor_parallel_size,
        tp_timeout_s=60.0,
    )
    return LLMEngine.from_config(config)


def make_engine_and_runner(
    args: argparse.Namespace, max_batch: int, steps: int
) -> tuple[LLMEngine, ModelRunner]:
    """The engine, and a bare runner on the same weights, each with room for `max_batch`
    sequences of the prompt plus `steps` tokens."""
    blocks_per_seq = -(-(args.prompt_len + steps + 1) // BLOCK_SIZE)
    engine = make_engine(args, max_batch, steps)
    loaded = engine.loaded
    runner = ModelRunner.create(loaded.model, max_batch * blocks_per_seq, BLOCK_SIZE, loaded.dtype)
    return engine, runner


@dataclass(frozen=True, slots=True)
class TPBatchFigures:
    tp1_tok_s: float  # medians over rounds
    tpn_tok_s: float
    ratio: float  # median of per-round TP=N / TP=1
    step_ms: float  # TP=N, per decode step on rank 0: in all,
    comm_ms: float  # in collectives,
    compute_ms: float  # the rest
    comm_frac: float
    collectives_per_step: float
    ratios: list[float]
    rounds: list[TPRound]


def tp_batch_figures(rounds: Sequence[TPRound]) -> TPBatchFigures:
    """One batch size's TP figures from its rounds."""
    ratios = [r.tpn_tok_s / r.tp1_tok_s for r in rounds]
    step_ms = median([r.step_ms for r in rounds])
    comm_ms = median([r.comm_ms for r in rounds])
    return TPBatchFigures(
        median([r.tp1_tok_s for r in rounds]),
        median([r.tpn_tok_s for r in rounds]),
        median(ratios),
        step_ms,
        comm_ms,
        step_ms - comm_ms,
        comm_ms / step_ms,
        median([r.collectives for r in rounds]),
        ratios,
        list(rounds),
    )


def measure_tp(
    args: argparse.Namespace, batches: list[int], steps: int, repeat: int
) -> dict[int, TPBatchFigures]:
    """Each batch's figures: TP=1 and TP=`args.tp` engines, their decode steps alternating."""
    single = make_engine(args, max(batches), steps)
    parallel = make_engine(args, max(batches), steps, tensor_parallel_size=int(args.tp))
    figures: dict[int, TPBatchFigures] = {}
    try:
        prompts = Prompts(args.prompt_len)
        for batch in batches:
            tp_round(single, parallel, prompts.take(batch), steps)  # warm-up
            rounds = [tp_round(single, parallel, prompts.take(batch), steps) for _ in range(repeat)]
            figures[batch] = tp_batch_figures(rounds)
    finally:
        parallel.close()
        single.close()
    return figures


def run_tp(args: argparse.Namespace, batches: list[int], steps: int, repeat: int) -> None:
    """TP=1 against TP=`args.tp` (see the docstring)."""
    size = int(args.tp)
    figures = measure_tp(args, batches, steps, repeat)
    rows: list[list[str | int | float]] = []
    metrics: dict[str, float] = {}
    for batch, f in figures.items():
        row: list[str | int | float] = [batch, f.tp1_tok_s, f.tpn_tok_s, f.ratio, f.step_ms]
        rows.append([*row, f.comm_ms, f.compute_ms, f.collectives_per_step])
        metrics |= {
            f"tp1_tok_s_b{batch}": f.tp1_tok_s,
            f"tp{size}_tok_s_b{batch}": f.tpn_tok_s,
            f"ratio_b{batch}": f.ratio,
            f"step_ms_b{batch}": f.step_ms,
            f"comm_ms_b{batch}": f.comm_ms,
            f"compute_ms_b{batch}": f.compute_ms,
            f"collectives_b{batch}": f.collectives_per_step,
        }
    headers = ["batch", "TP=1 tok/s", f"TP={size} tok/s", "ratio", "ms/step", "comm ms"]
    print_table(
        f"decode tok/s, tiny model, TP=1 vs TP={size}, {args.threads} threads per rank, prompt "
        f"{args.prompt_len}, {steps} steps, median of {repeat}; the TP={size} step on rank 0",
        [*headers, "compute ms", "collectives/step"],
        rows,
    )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    note = (
        f"CPU: the {size} ranks ({args.threads} threads each) are processes sharing this box's "
        f"{cores} cores, their collectives through shared memory (gloo beyond a slot): TP={size} "
        "uses more cores than TP=1 here, so the ratio mixes those with the collectives' cost"
    )
    print(f"\n{note}")
    results = {
        "tensor_parallel_size": size,
        "batches": {str(batch): asdict(f) for batch, f in figures.items()},
        "steps": steps,
        "prompt_len": args.prompt_len,
        "threads": args.threads,
        "repeat": repeat,
        "cores": cores,
        "note": note,
        "comm": "rank 0's TPGroup.stats: the step broadcast, all-reduces and logits gather, "
        "waits for the other ranks included",
    }
    finish(TP_NAME, args, results, metrics)


# -- mixture of experts -------------------------------------------------------------------------


class ModuleTimer:
    """Wall seconds spent inside a set of modules, summed over their calls (a forward pre-hook
    and a forward hook on each; CPU ops are synchronous, so the call's wall time is its work).
    While `capture` is set, each module's positional inputs of its latest call are kept (cloned
    before its clock starts)."""

    def __init__(self, modules: Sequence[torch.nn.Module]) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.capture = False
        self.inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._started: dict[int, float] = {}
        for index, module in enumerate(modules):
            module.register_forward_pre_hook(partial(self._enter, index))
            module.register_forward_hook(partial(self._leave, index))

    def _enter(self, index: int, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if self.capture:
            self.inputs[index] = tuple(a.clone() for a in args)
        self._started[index] = time.perf_counter()

    def _leave(self, index: int, module: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
        self.seconds += time.perf_counter() - self._started.pop(index)
        self.calls += 1


@dataclass(frozen=True, slots=True)
class MoERound:
    """One round of decode steps at one batch: ms per step in all, in the MoE blocks, in their
    experts."""

    tok_s: float
    step_ms: float
    moe_ms: float
    experts_ms: float

    @property
    def moe_share(self) -> float:
        return self.moe_ms / self.step_ms

    @property
    def experts_share(self) -> float:
        return self.experts_ms / self.step_ms


def moe_round(
    engine: LLMEngine,
    blocks: ModuleTimer,
    experts: ModuleTimer,
    prompts: Sequence[list[int]],
    steps: int,
) -> MoERound:
    """`steps` decode steps of the batch (prefilled first, untimed), each timed; the experts'
    inputs of the last step kept in `experts.inputs`."""
    decoder = EngineDecoder(engine, prompts, steps)
    moe_before, experts_before = blocks.seconds, experts.seconds
    seconds = 0.0
    for i in range(steps):
        experts.capture = i == steps - 1
        start = time.perf_counter()
        decoder.step()
        seconds += time.perf_counter() - start
    experts.capture = False
    check_produced(engine, decoder, steps * len(prompts))
    return MoERound(
        decoder.produced / seconds,
        1e3 * seconds / steps,
        1e3 * (blocks.seconds - moe_before) / steps,
        1e3 * (experts.seconds - experts_before) / steps,
    )


def time_experts(
    modules: Sequence[Experts], inputs: dict[int, tuple[torch.Tensor, ...]], batch: int
) -> dict[str, Any]:
    """`Experts.forward` of each layer alone on its captured inputs (`[batch, hidden]` hidden
    states, the router's ids and weights): µs per token per layer, and the routes' shape."""
    per_layer_us, active, rows = [], [], []
    number = max(1, 32 // batch)
    with torch.inference_mode():
        for index, module in enumerate(modules):
            x, ids, weights = inputs[index]
            if x.shape[0] != batch:
                raise RuntimeError(f"layer {index}: captured {x.shape[0]} tokens, not {batch}")
            seconds = median_seconds(
                lambda m=module, a=(x, ids, weights): m(*a), repeat=5, number=number
            )
            per_layer_us.append(1e6 * seconds / batch)
            used = int(torch.unique(ids).numel())
            active.append(used)
            rows.append(ids.numel() / used)
    return {
        "us_per_token_layer_mean": sum(per_layer_us) / len(per_layer_us),
        "us_per_token_model": sum(per_layer_us),
        "us_per_token_by_layer": per_layer_us,
        "active_experts_by_layer": active,
        "rows_per_active_expert_by_layer": rows,
    }


def moe_engine(args: argparse.Namespace, model: Path, max_batch: int, steps: int) -> LLMEngine:
    """An engine on `model` with room for `max_batch` sequences of the prompt plus `steps`
    tokens (twice, as `make_engine`'s)."""
    blocks_per_seq = -(-(args.prompt_len + steps + 1) // BLOCK_SIZE)
    config = EngineConfig(
        model=str(model),
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_kv_blocks=2 * max_batch * blocks_per_seq + 16,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(512, max_batch * args.prompt_len),
        torch_threads=args.threads,
    )
    return LLMEngine.from_config(config)


def run_moe(
    args: argparse.Namespace, repeat: int
) -> tuple[dict[str, Any], dict[str, float], list[list[str | int | float]]]:
    """The MoE blocks' share of a decode step and the experts' µs per token, per batch."""
    from vs_vllm import moe_model_dir

    batches = [int(b) for b in args.moe_batches.split(",")]
    steps = args.moe_steps or (4 if args.quick else 16)
    rounds_per_batch = 1 if args.quick else repeat
    model = moe_model_dir(args.moe_layers)
    engine = moe_engine(args, model, max(batches), steps)
    try:
        network = engine.loaded.model
        blocks = ModuleTimer([m for m in network.modules() if isinstance(m, SparseMoE)])
        expert_modules = [m for m in network.modules() if isinstance(m, Experts)]
        experts = ModuleTimer(expert_modules)
        prompts = Prompts(args.prompt_len)
        figures: dict[str, Any] = {}
        metrics: dict[str, float] = {}
        rows: list[list[str | int | float]] = []
        for batch in batches:
            moe_round(engine, blocks, experts, prompts.take(batch), 2)  # warm-up
            rounds = [
                moe_round(engine, blocks, experts, prompts.take(batch), steps)
                for _ in range(rounds_per_batch)
            ]
            timed = time_experts(expert_modules, experts.inputs, batch)
            share = median([r.moe_share for r in rounds])
            expert_us = timed["us_per_token_layer_mean"]
            figures[str(batch)] = {
                "tok_s": median([r.tok_s for r in rounds]),
                "step_ms": median([r.step_ms for r in rounds]),
                "moe_ms": median([r.moe_ms for r in rounds]),
                "experts_ms": median([r.experts_ms for r in rounds]),
                "moe_share": share,
                "experts_share": median([r.experts_share for r in rounds]),
                "experts_alone": timed,
                "rounds": [asdict(r) for r in rounds],
            }
            f = figures[str(batch)]
            metrics[f"moe_share_b{batch}"] = share
            metrics[f"expert_us_per_tok_b{batch}"] = expert_us
            active = median(timed["active_experts_by_layer"])
            row: list[str | int | float] = [batch, f["tok_s"], f["step_ms"], f["moe_ms"], share]
            rows.append([*row, f["experts_share"], expert_us, timed["us_per_token_model"], active])
    finally:
        engine.close()
    config = engine.loaded.config
    assert config.moe is not None
    results = {
        "model_dir": str(model),
        "layers": config.num_layers,
        "num_experts": config.moe.num_experts,
        "top_k": config.moe.top_k,
        "expert_width": config.moe.intermediate_size,
        "hidden": config.hidden_size,
        "steps": steps,
        "rounds": rounds_per_batch,
        "prompt_len": args.prompt_len,
        "threads": args.threads,
        "method": "forward hooks (perf_counter) on every SparseMoE block and Experts module "
        "during engine decode steps; Experts.forward then timed alone on the last step's "
        "captured inputs",
        "batches": figures,
    }
    return results, metrics, rows


def main() -> None:
    args = parse_args(__doc__ or NAME, configure)
    batches = [int(b) for b in args.batches.split(",")]
    steps = args.steps or (16 if args.quick else 64)
    repeat = repeats(args, quick=3, full=5)
    torch.set_num_threads(args.threads)
    if args.tp is not None:
        if args.tp < 2:
            raise SystemExit("--tp must be at least 2 (TP=1 is the baseline it is compared with)")
        run_tp(args, batches, steps, repeat)
        return

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
    if not args.skip_moe:
        moe, moe_metrics, moe_rows = run_moe(args, repeat)
        print_table(
            f"mixture of experts: random Qwen3-MoE ({moe['num_experts']} experts, top "
            f"{moe['top_k']}, width {moe['expert_width']}, {moe['layers']} layers), "
            f"{args.threads} threads, prompt {args.prompt_len}, {moe['steps']} decode steps, "
            f"median of {moe['rounds']}",
            MOE_HEADERS,
            moe_rows,
        )
        results["moe"] = moe
        metrics |= moe_metrics
    finish(NAME, args, results, metrics)


if __name__ == "__main__":
    main()

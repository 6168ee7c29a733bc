"""The FP8 KV cache against the full-precision one, on the same model and prompts.

For the tiny model and a ~156M-parameter random Llama (`vs_vllm.py`'s `big` model, 8 layers),
both run in bfloat16 (the cache's full precision is then bfloat16: FP8 must halve its bytes):

- KV bytes per token, each cache (`KVLayout.bytes_per_token`);
- the error FP8 costs: over `--prompts` prompts (64 by default) of random tokens, the logits at
  the prompt's last position and after each of `--steps` greedy steps, compared position by
  position with the full-precision engine's (both decode the full-precision engine's tokens, so
  the error does not compound through different continuations): max and mean |delta logit|,
  both also relative to the logits' largest magnitude; and greedy agreement: the share of
  positions whose argmax is the same, and the share of prompts whose whole greedy continuation
  (each engine its own) is identical;
- decode throughput, tokens/s of a batch of `--batch` sequences, each cache, alternating A/B
  `--repeat` times (median).

Prints a table, writes benchmarks/results/kv_fp8.json, ends with one RESULT line.
"""

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from _common import finish, median, parse_args, print_table, repeats
from vs_vllm import big_model_dir

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import SamplingParams
from pdserve.model.runner import ModelRunner, SequenceChunk
from pdserve.model.tiny import default_model_dir

BLOCK = 16


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=None, help="prompts compared (64)")
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--steps", type=int, default=None, help="greedy steps per prompt (32)")
    parser.add_argument("--batch", type=int, default=16, help="sequences decoded together")
    parser.add_argument("--threads", type=int, default=2)


def engine(model: Path, kv_cache_dtype: str, blocks: int) -> LLMEngine:
    return LLMEngine.from_config(
        EngineConfig(
            model=str(model),
            dtype="bfloat16",
            kv_cache_dtype=kv_cache_dtype,
            num_kv_blocks=blocks,
            block_size=BLOCK,
            max_num_seqs=64,
        )
    )


def prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(3, vocab, (count, length), generator=generator).tolist()  # type: ignore[no-any-return]


def logits_along(engine: LLMEngine, tokens: list[int], continuation: list[int]) -> torch.Tensor:
    """Logits at the prompt's last position and after each token of `continuation` (fed as
    decode steps), `[1 + len(continuation), vocab]`, on a cache of its own (laid out as the
    engine's: FP8 or not) so that the engine's prefix cache stays as it is."""
    blocks = range(-(-(len(tokens) + len(continuation)) // BLOCK))
    loaded = engine.loaded
    runner = ModelRunner.create(loaded.model, len(blocks), BLOCK, loaded.dtype)
    rows = [runner.execute([SequenceChunk(tokens, 0, blocks, True)])[0]]
    for i, token in enumerate(continuation[:-1]):
        rows.append(runner.execute([SequenceChunk([token], len(tokens) + i, blocks, True)])[0])
    return torch.stack(rows)


def error_figures(
    full: LLMEngine, fp8: LLMEngine, batch: list[list[int]], steps: int
) -> dict[str, Any]:
    greedy = SamplingParams(max_tokens=steps, ignore_eos=True)
    full_out = [list(c.token_ids) for c in full.generate(batch, greedy)]
    fp8_out = [list(c.token_ids) for c in fp8.generate(batch, greedy)]
    deltas, scales, agree, positions = [], [], 0, 0
    for tokens, continuation in zip(batch, full_out, strict=True):
        reference = logits_along(full, tokens, continuation)
        quantised = logits_along(fp8, tokens, continuation)
        delta = (quantised - reference).abs()
        deltas.append(delta)
        scales.append(reference.abs().amax(dim=-1, keepdim=True).expand_as(delta))
        agree += int((quantised.argmax(-1) == reference.argmax(-1)).sum())
        positions += reference.shape[0]
    delta, scale = torch.cat(deltas), torch.cat(scales)
    return {
        "max_abs_delta_logit": float(delta.max()),
        "mean_abs_delta_logit": float(delta.mean()),
        "max_rel_delta_logit": float((delta / scale).max()),
        "mean_rel_delta_logit": float((delta / scale).mean()),
        "argmax_agreement": agree / positions,
        "identical_continuations": sum(a == b for a, b in zip(full_out, fp8_out, strict=True))
        / len(batch),
        "positions": positions,
    }


def decode_tokens_per_s(engine: LLMEngine, batch: list[list[int]], steps: int) -> float:
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    start = time.perf_counter()
    completions = engine.generate(batch, params)
    elapsed = time.perf_counter() - start
    return sum(len(c.token_ids) for c in completions) / elapsed


def measure(args: argparse.Namespace, name: str, model: Path) -> dict[str, Any]:
    count = args.prompts or (8 if args.quick else 64)
    steps = args.steps or (8 if args.quick else 32)
    blocks = 4 * -(-(args.prompt_len + steps) // BLOCK) * max(args.batch, 1) + 8
    engines = {dtype: engine(model, dtype, blocks) for dtype in ("auto", "fp8_e4m3")}
    full, fp8 = engines["auto"], engines["fp8_e4m3"]
    vocab = full.loaded.config.vocab_size
    batch = prompts(count, args.prompt_len, vocab)
    figures: dict[str, Any] = {
        "kv_bytes_per_token": full.loaded.model.kv_layout(full.loaded.dtype).bytes_per_token(),
        "kv_bytes_per_token_fp8": fp8.loaded.model.kv_layout(fp8.loaded.dtype).bytes_per_token(),
        "scales": fp8.loaded.model.kv_scales.source if fp8.loaded.model.kv_scales else None,
        **error_figures(full, fp8, batch, steps),
    }
    timing_batch = batch[: args.batch]
    samples: dict[str, list[float]] = {"auto": [], "fp8_e4m3": []}
    for _ in range(repeats(args, quick=1, full=3)):
        for dtype in ("auto", "fp8_e4m3"):  # alternating A/B
            samples[dtype].append(decode_tokens_per_s(engines[dtype], timing_batch, steps))
    figures["tokens_per_s"] = median(samples["auto"])
    figures["tokens_per_s_fp8"] = median(samples["fp8_e4m3"])
    figures["samples"] = samples
    for each in engines.values():
        each.close()
    print_table(
        f"{name}: FP8 KV cache vs bfloat16",
        ["figure", "value"],
        [[k, v] for k, v in figures.items() if k != "samples"],
    )
    return figures


def main() -> None:
    args = parse_args(__doc__ or "", configure)
    torch.set_num_threads(args.threads)
    results = {
        "tiny": measure(args, "tiny", default_model_dir()),
        "llama_156m": measure(args, "llama_156m", big_model_dir(8)),
    }
    metrics: dict[str, float] = {}
    for name, figures in results.items():
        metrics[f"{name}_bytes_ratio"] = (
            figures["kv_bytes_per_token_fp8"] / figures["kv_bytes_per_token"]
        )
        metrics[f"{name}_max_abs_delta"] = figures["max_abs_delta_logit"]
        metrics[f"{name}_mean_abs_delta"] = figures["mean_abs_delta_logit"]
        metrics[f"{name}_argmax_agreement"] = figures["argmax_agreement"]
        metrics[f"{name}_identical_continuations"] = figures["identical_continuations"]
        metrics[f"{name}_speed_ratio"] = figures["tokens_per_s_fp8"] / figures["tokens_per_s"]
    finish("kv_fp8", args, results, metrics)


if __name__ == "__main__":
    main()

"""GPU check: pdserve's correctness, decode speed, KV staging and memory sizing on one GPU.

    python3 benchmarks/gpu_check.py [--out PATH | --out-dir DIR]  # GPU host: ~2-3 min (estimate)
    python benchmarks/gpu_check.py --smoke [--out PATH]            # tiny sizes on CPU: ~6 s

benchmarks/README.md ("GPU check") has the wheels to carry to a GPU host and the command to run.

One run of a few minutes, made for a short GPU lease: each section runs under its own time limit
(and the whole run under `--budget-s`), and a section that fails is recorded as
`{"error": ...}` while the others still run. The JSON is rewritten after every section.

- environment: Python, torch and CUDA, the GPU (torch and nvidia-smi), pdserve's commit and source
  digest, the versions of the packages pdserve imports;
- correctness: a random Llama-3-8B-shaped model (hidden 4096, 32 heads and 8 KV heads of 128, MLP
  14336, vocab 128,256, rope theta 500,000; `--layers` decoder layers, 4 by default) made by
  `transformers` (fixed seed) and saved as bfloat16 safetensors, then loaded by pdserve: peak
  device memory of the load ÷ weight bytes; prefill logits against `transformers` (eager attention,
  same dtype and device); greedy tokens of `LLMEngine` against `generate(do_sample=False)`; one
  prompt's logits alone against in a batch of 4 (`ModelRunner`, prefill and one decode step);
- decode: ms per engine step (CUDA graphs on, the default) at batch 1/32/64/128 (512-token
  prompts, ignore_eos, warm-up first, synchronised timing) against a bare `ModelRunner` loop on
  the same weights and batch, and against the HBM roofline: (weight bytes + KV bytes read per
  step) ÷ HBM_BYTES_PER_S;
- cuda_graphs: the same decode steps with `engine.cuda_graphs` off and on (the decode section
  runs with the default, on), and the greedy tokens of 8 prompts both ways;
- staging: Llama-3-8B KV blocks (2 MiB: 32 layers x K,V x 16 tokens x 8 heads x 128 x 2 bytes)
  gathered by index_select and copied device -> pinned host on a copy stream (and back), runs of
  1/16/128 blocks, against a pageable `.cpu()` per block; GPU -> GPU copies (and between two
  devices when two are visible); `pdserve.model.staging.KVStager` when it exists;
- memory: an engine started with the default KV sizing: its `kv_plan` and `memory` when it has
  them, KV blocks, context window, `torch.cuda.mem_get_info`.
- tensor_parallel: with two GPUs (the run's device and the next one), an engine with
  `tensor_parallel_size` 2 (rank 1 a local worker process on the next GPU, NCCL) against a TP=1
  engine, both without CUDA graphs (TP has none yet) and without storage (not supported for a TP
  CUDA instance): last-position prefill logits and the greedy tokens of 8 prompts, ms per decode
  step and tok/s at the smallest and largest batch, and TP=2's step split on rank 0 (ms in
  collectives: `TPGroup.stats`, the step broadcast, all-reduces and logits gather, which on CUDA
  wait for the GPU, so queued compute counts there too; the rest; collectives per step). With
  fewer GPUs: `{"skipped": "needs 2 GPUs, found N"}`.
- families: per family (Qwen3-8B, Qwen3-30B-A3B and Mixtral-8x7B shapes, DeepSeek-V3's attention
  and experts with 64 of its 256 experts), `FAMILY_LAYERS` layers written by `transformers` in the
  run's dtype: greedy tokens against `generate`, ms per decode step; the fused MoE kernel against
  the grouped path; DeepSeek-V3's latent-attention decode (the Triton kernel) against the torch
  reference on a paged cache of random latents, and ms of each;
- fp8_kv: the correctness model with `kv_cache_dtype: fp8_e4m3` against full precision: KV bytes
  per token, prefill logits' largest difference, greedy agreement, ms per decode step.

`--smoke` runs every section at tiny sizes (hidden 256, 2 layers, vocab 32,000, float32, batches
1/4) so that CPU-only machines can check that the script works; what needs CUDA is recorded as
`{"skipped": "no CUDA"}`; the tensor_parallel section runs its two ranks on CPU (gloo): the
script's path, not GPUs. It writes only where `--out` / `--out-dir` say, else to a temporary
file: `benchmarks/results/gpu_check.json` holds GPU runs only. The last stdout line is
`RESULT gpu_check key=value ...` (`na` for a figure this run did not measure).
"""

import argparse
import contextlib
import dataclasses
import functools
import gc
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from _common import RESULTS_DIR, format_value, machine_info, median, print_table

NAME = "gpu_check"
ROOT = Path(__file__).resolve().parent.parent
HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e, the vendor's datasheet
HBM_SOURCE = "NVIDIA H200 HBM3e, 4.8 TB/s (datasheet)"
LOAD_PEAK_TARGET = 1.1  # a load's peak device memory must stay <= 1.1 x the weights
BLOCK_SIZE = 16
SEED = 1234
BOS, EOS = 1, 2
# every reference checkpoint: an untied head, eager attention, the word-level tokenizer's ids
REFERENCE_SETTINGS = {
    "tie_word_embeddings": False,
    "attn_implementation": "eager",
    "bos_token_id": BOS,
    "eos_token_id": EOS,
}
ENGINE_SLACK_TOKENS = 64  # max_tokens beyond the timed steps: decoding during others' prefill
MIN_SECTION_S = 10.0  # a section is skipped when less of the budget is left
NO_CUDA = {"skipped": "no CUDA"}
TP_SIZE = 2

LLAMA3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
}
LLAMA3_8B_LAYERS = 32
SMOKE_ARCH = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 32000,
    "rope_theta": 500000.0,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
}


@dataclass(frozen=True, slots=True)
class Sizes:
    arch: Mapping[str, Any]
    layers: int
    dtype: str
    prompts: int  # correctness prompts (also the batch of the batch-variance check)
    prompt_len: int
    greedy_tokens: int
    batches: tuple[int, ...]
    decode_prompt_len: int
    warmup: int
    steps: int
    prefill_budget: int  # max_num_batched_tokens of the engines
    stage_block: tuple[int, ...]  # one block's shape: layers, K/V, tokens, kv heads, head dim
    stage_cache_blocks: int
    stage_runs: tuple[int, ...]
    repeat: int
    d2d_bytes: int


FULL = Sizes(
    arch=LLAMA3_8B,
    layers=4,
    dtype="bfloat16",
    prompts=4,
    prompt_len=128,
    greedy_tokens=64,
    batches=(1, 32, 64, 128),
    decode_prompt_len=512,
    warmup=3,
    steps=20,
    prefill_budget=8192,
    stage_block=(LLAMA3_8B_LAYERS, 2, BLOCK_SIZE, 8, 128),  # 2 MiB in bf16
    stage_cache_blocks=512,
    stage_runs=(1, 16, 128),
    repeat=10,
    d2d_bytes=2 * 2**30,
)
SMOKE = Sizes(
    arch=SMOKE_ARCH,
    layers=2,
    dtype="float32",  # pdserve and transformers then agree on every greedy token
    prompts=4,
    prompt_len=16,
    greedy_tokens=8,
    batches=(1, 4),
    decode_prompt_len=16,
    warmup=1,
    steps=4,
    prefill_budget=512,
    stage_block=(2, 2, BLOCK_SIZE, 2, 64),
    stage_cache_blocks=32,
    stage_runs=(1, 4, 16),
    repeat=3,
    d2d_bytes=16 * 2**20,
)


@dataclass(slots=True)
class Context:
    args: argparse.Namespace
    sizes: Sizes
    device: torch.device
    work: Path
    started: float
    deadline: float
    model_dir: Path | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.sizes.dtype]

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def log(ctx: Context, message: str) -> None:
    print(f"[{time.perf_counter() - ctx.started:6.1f} s] {message}", flush=True)


def release(ctx: Context) -> None:
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def attempt(work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One part of a section: its failure is recorded there and the section goes on."""
    try:
        return work()
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    prompts: list[list[int]] = torch.randint(
        3, vocab, (count, length), generator=generator
    ).tolist()
    return prompts


# -- 1. environment ---------------------------------------------------------------------------


def environment(ctx: Context) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device": str(ctx.device),
        "dtype": ctx.sizes.dtype,
        "smoke": ctx.args.smoke,
        "pdserve_commit": ctx.args.commit or git_commit(),
        "pdserve_source_sha256": source_digest(),
        "packages": package_versions(),
    }
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        info |= {
            "gpu_name": props.name,
            "gpu_memory_bytes": props.total_memory,
            "multiprocessors": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}",
            "device_count": torch.cuda.device_count(),
        }
    info["nvidia_smi"] = nvidia_smi()
    return info


def nvidia_smi() -> dict[str, Any]:
    if shutil.which("nvidia-smi") is None:
        return {"skipped": "no nvidia-smi"}
    fields = "name,memory.total,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw"
    query = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"]
    done = subprocess.run(query, capture_output=True, text=True, timeout=15, check=False)
    if done.returncode != 0:
        return {"error": f"nvidia-smi exited {done.returncode}: {done.stderr.strip()[:200]}"}
    rows = [line.split(", ") for line in done.stdout.strip().splitlines()]
    return {"gpus": [dict(zip(fields.split(","), row, strict=False)) for row in rows]}


def git_commit() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if done.returncode == 0:
            return done.stdout.strip()
    return None  # a copied working tree without .git: the source digest still names the code


def source_digest() -> str:
    """sha256 over pdserve's Python files (path and bytes): the code, with or without git."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "pdserve").rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def package_versions() -> dict[str, str | None]:
    names = {
        "transformers": "transformers",
        "tokenizers": "tokenizers",
        "safetensors": "safetensors",
        "numpy": "numpy",
        "grpcio": "grpc",
        "protobuf": "google.protobuf",
        "redis": "redis",
        "platformdirs": "platformdirs",
        "pyyaml": "yaml",
        "jinja2": "jinja2",
    }
    versions: dict[str, str | None] = {}
    for dist, module in names.items():
        try:  # the imported module's own version: the one that runs (PYTHONPATH wins)
            versions[dist] = str(getattr(importlib.import_module(module), "__version__", None))
        except Exception as error:
            note = f"not importable: {type(error).__name__}"
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                note += f" (installed {importlib.metadata.version(dist)})"
            versions[dist] = note
    return versions


# -- 2. correctness ---------------------------------------------------------------------------


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def write_model(ctx: Context) -> tuple[Path, torch.nn.Module]:
    """A random Llama directory written by `transformers` (safetensors in the run's dtype, a
    word-level tokenizer covering the whole vocabulary) and the `transformers` model itself."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" bars would bury the output
    arch = dict(ctx.sizes.arch)
    theta = arch.pop("rope_theta")
    config = LlamaConfig(
        **arch,
        num_hidden_layers=ctx.sizes.layers,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        **REFERENCE_SETTINGS,
    )
    torch.manual_seed(SEED)
    with default_dtype(ctx.dtype), ctx.device:
        reference = LlamaForCausalLM(config).eval()
    path = ctx.work / "model"
    reference.save_pretrained(path)
    write_tokenizer(path, int(arch["vocab_size"]))
    reference.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    ctx.model_dir = path
    return path, reference


def write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": BOS, "</s>": EOS} | {f"t{i}": i for i in range(3, vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def model_path(ctx: Context) -> Path:
    """The run's model directory, written on first use (by whichever section needs it first)."""
    if ctx.model_dir is None:
        path, reference = write_model(ctx)
        del reference
        release(ctx)
        return path
    return ctx.model_dir


def correctness(ctx: Context) -> dict[str, Any]:
    s = ctx.sizes
    model_dir, reference = write_model(ctx)
    log(ctx, f"correctness: model written ({weight_bytes(reference) / 2**30:.2f} GiB)")
    prompts = random_prompts(s.prompts, s.prompt_len, int(s.arch["vocab_size"]), SEED)
    result: dict[str, Any] = {
        "model": {
            "layers": s.layers,
            "params": sum(p.numel() for p in reference.parameters()),
            "weight_bytes": weight_bytes(reference),
            "arch": dict(s.arch),
            "dtype": s.dtype,
            "reference_attention": getattr(reference.config, "_attn_implementation", None),
        }
    }
    loaded, result["load"] = load_figures(ctx, model_dir)
    result |= runner_checks(ctx, loaded.model, reference, prompts)
    del loaded  # the engine of the greedy check loads its own copy
    release(ctx)
    result["greedy"] = attempt(lambda: greedy_agreement(ctx, reference, model_dir, prompts))
    return result


def runner_checks(
    ctx: Context, model: Any, reference: torch.nn.Module, prompts: list[list[int]]
) -> dict[str, Any]:
    from pdserve.model.runner import ModelRunner

    per_seq = blocks_for(len(prompts[0]) + 1)
    slots = 2 * len(prompts) + 1  # this batch, then one prompt alone, then the batch again
    runner = ModelRunner.create(model, slots * per_seq, BLOCK_SIZE, ctx.dtype)
    return {
        "prefill": attempt(lambda: prefill_agreement(ctx, runner, reference, prompts)),
        "batch_variance": attempt(lambda: batch_variance(runner, prompts, per_seq)),
    }


def load_figures(ctx: Context, model_dir: Path) -> tuple[Any, dict[str, Any]]:
    from pdserve.model.loader import load_model

    before = 0
    if ctx.cuda:
        ctx.sync()
        torch.cuda.reset_peak_memory_stats(ctx.device)
        before = torch.cuda.memory_allocated(ctx.device)
    start = time.perf_counter()
    loaded = load_model(model_dir, dtype=ctx.sizes.dtype, device=str(ctx.device))
    ctx.sync()
    weights = weight_bytes(loaded.model)
    figures: dict[str, Any] = {
        "load_s": time.perf_counter() - start,
        "weight_bytes": weights,
        "file_bytes": sum(f.stat().st_size for f in model_dir.glob("*.safetensors")),
        "peak": dict(NO_CUDA),
    }
    if ctx.cuda:
        peak = torch.cuda.max_memory_allocated(ctx.device) - before
        figures["peak"] = {
            "load_peak_bytes": peak,
            "resident_bytes": torch.cuda.memory_allocated(ctx.device) - before,
            "load_peak_ratio": peak / weights,
            "target": LOAD_PEAK_TARGET,
            "verdict": "PASS" if peak / weights <= LOAD_PEAK_TARGET else "FAIL",
        }
    return loaded, figures


def prefill_agreement(
    ctx: Context, runner: Any, reference: torch.nn.Module, prompts: list[list[int]]
) -> dict[str, Any]:
    """Every position's logits of each prompt (one batch), pdserve against `transformers`."""
    from pdserve.model.runner import SequenceChunk

    per_seq = blocks_for(len(prompts[0]) + 1)
    chunks = [
        SequenceChunk(p, 0, range(i * per_seq, (i + 1) * per_seq), True, all_logits=True)
        for i, p in enumerate(prompts)
    ]
    _, every = runner.execute_all(chunks)
    ours = torch.stack([every[i] for i in range(len(prompts))])
    with torch.inference_mode():
        theirs = reference(input_ids=torch.tensor(prompts, device=ctx.device)).logits.float()
    diff = (ours - theirs).abs()
    return {
        "logit_maxdiff": float(diff.max()),
        "logit_meandiff": float(diff.mean()),
        "logit_absmax": float(theirs.abs().max()),
        "top1_agree": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()),
        "prompts": len(prompts),
        "prompt_len": len(prompts[0]),
    }


def batch_variance(runner: Any, prompts: list[list[int]], per_seq: int) -> dict[str, Any]:
    """Prompt 0's last-position logits, then one decode step's, alone and in a batch of all."""
    from pdserve.model.runner import SequenceChunk

    def table(slot: int) -> range:
        return range(slot * per_seq, (slot + 1) * per_seq)

    first = len(prompts)  # slots 0.. hold prefill_agreement's KV: use fresh ones
    alone = runner.execute([SequenceChunk(prompts[0], 0, table(first), True)])[0]
    token = int(alone.argmax())
    step = SequenceChunk([token], len(prompts[0]), table(first), True)
    alone_step = runner.execute([step])[0]
    tables = [table(first + 1 + i) for i in range(len(prompts))]
    batch = runner.execute(
        [SequenceChunk(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)]
    )
    steps = [SequenceChunk([token], len(prompts[0]), t, True) for t in tables]
    batch_step = runner.execute(steps)
    return {
        "prefill_maxdiff": float((alone - batch[0]).abs().max()),
        "decode_maxdiff": float((alone_step - batch_step[0]).abs().max()),
        "batch": len(prompts),
    }


def greedy_agreement(
    ctx: Context, reference: Any, model_dir: Path, prompts: list[list[int]]
) -> dict[str, Any]:
    from pdserve.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.request import SamplingParams

    n = ctx.sizes.greedy_tokens
    config = EngineConfig(
        model=str(model_dir),
        device=str(ctx.device),
        dtype=ctx.sizes.dtype,
        num_kv_blocks=len(prompts) * blocks_for(len(prompts[0]) + n) + 4,
        max_num_batched_tokens=max(512, len(prompts) * len(prompts[0])),
    )
    engine = LLMEngine.from_config(config)
    done = engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    ours = [list(c.token_ids) for c in done]
    del engine
    release(ctx)
    ids = torch.tensor(prompts, device=ctx.device)
    with torch.inference_mode():
        out = reference.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
            do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
    theirs = out.sequences[:, ids.shape[1] :].tolist()
    firsts = [first_difference(x, y) for x, y in zip(ours, theirs, strict=True)]
    margins = []  # transformers' top-1 minus top-2 logit where they first differ: a near tie?
    for row, position in enumerate(firsts):
        if position < n:
            top = out.scores[position][row].float().topk(2).values
            margins.append(float(top[0] - top[1]))
    return {
        "greedy_agree": sum(firsts) / (n * len(prompts)),
        "first_divergence": firsts,
        "margins_at_divergence": margins,
        "tokens": n,
        "exact": all(f == n for f in firsts),
    }


def first_difference(ours: Sequence[int], theirs: Sequence[int]) -> int:
    for position, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return position
    return min(len(ours), len(theirs))


# -- 3. decode --------------------------------------------------------------------------------


def decode_blocks_per_seq(ctx: Context) -> int:
    s = ctx.sizes
    return blocks_for(s.decode_prompt_len + s.warmup + s.steps + ENGINE_SLACK_TOKENS)


def decode_engine(ctx: Context, capture: Any = None, **settings: Any) -> Any:
    """An engine for the decode batches (CUDA graphs as the default, unless `settings` say;
    `capture`: `LLMEngine.from_config`'s graph_capture)."""
    from pdserve.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    s = ctx.sizes
    biggest = max(s.batches)
    config = EngineConfig(
        model=str(model_path(ctx)),
        device=str(ctx.device),
        dtype=s.dtype,
        block_size=BLOCK_SIZE,
        num_kv_blocks=biggest * decode_blocks_per_seq(ctx) + 16,
        max_num_seqs=biggest,
        max_num_batched_tokens=s.prefill_budget,
        **settings,
    )
    return LLMEngine.from_config(config, graph_capture=capture)


def decode(ctx: Context) -> dict[str, Any]:
    from pdserve.model.runner import ModelRunner

    s = ctx.sizes
    biggest = max(s.batches)
    per_seq = decode_blocks_per_seq(ctx)
    engine = decode_engine(ctx)
    loaded = engine.loaded
    runner = ModelRunner.create(loaded.model, biggest * per_seq, BLOCK_SIZE, loaded.dtype)
    kv_per_token = loaded.model.kv_layout(loaded.dtype).bytes_per_token()
    context = s.decode_prompt_len + 1 + s.warmup + s.steps / 2  # mean over the timed steps
    batches: dict[str, Any] = {}
    for batch in s.batches:
        prompts = random_prompts(batch, s.decode_prompt_len, int(s.arch["vocab_size"]), batch)
        ours = engine_decode_ms(ctx, engine, prompts)
        bare = bare_decode_ms(ctx, runner, prompts, per_seq)
        figures: dict[str, Any] = {
            "engine_ms": median(ours),
            "bare_ms": median(bare),
            "overhead_ms": median(ours) - median(bare),
            "engine_samples_ms": ours,
            "bare_samples_ms": bare,
        }
        reads = weight_bytes_read(loaded.model, batch) + batch * context * kv_per_token
        figures["roofline"] = roofline(ctx, reads, median(ours), median(bare))
        batches[str(batch)] = figures
        log(ctx, f"decode: batch {batch}: engine {median(ours):.2f} ms, bare {median(bare):.2f} ms")
    return {
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
        "hbm_source": HBM_SOURCE,
        "prompt_len": s.decode_prompt_len,
        "warmup_steps": s.warmup,
        "timed_steps": s.steps,
        "mean_context": context,
        "kv_bytes_per_token": kv_per_token,
        "batches": batches,
    }


def cuda_graphs(ctx: Context) -> dict[str, Any]:
    """The decode step with `engine.cuda_graphs` off and on (the default on CUDA): ms per step at
    the smallest and largest batch, the engine's start time (capture included), and whether 8
    prompts decode to the same greedy tokens both ways. Without CUDA (`--smoke`) the "graphs"
    engine replays its static buffers eagerly (`eager_capture`): the script's path, not a
    graph."""
    from pdserve.engine.request import SamplingParams
    from pdserve.model.graphs import eager_capture

    s = ctx.sizes
    vocab = int(s.arch["vocab_size"])
    result: dict[str, Any] = {}
    tokens: dict[str, list[list[int]]] = {}
    for graphs in (False, True):
        name = "graphs" if graphs else "eager"
        start = time.perf_counter()
        if ctx.cuda:
            engine = decode_engine(ctx, cuda_graphs=graphs)
        else:  # --smoke on CPU: the same steps with the graphs' buffers, replayed eagerly
            engine = decode_engine(ctx, capture=eager_capture if graphs else None)
        ctx.sync()
        figures: dict[str, Any] = {"start_s": time.perf_counter() - start, "decode_ms": {}}
        for batch in (min(s.batches), max(s.batches)):
            prompts = random_prompts(batch, s.decode_prompt_len, vocab, batch)
            figures["decode_ms"][str(batch)] = median(engine_decode_ms(ctx, engine, prompts))
        params = SamplingParams(max_tokens=s.greedy_tokens, ignore_eos=True)
        done = engine.generate(random_prompts(8, 64, vocab, seed=7), params)
        tokens[name] = [list(c.token_ids) for c in done]
        result[name] = figures
        log(ctx, f"cuda_graphs: {name}: {figures['decode_ms']} ms per step")
        del engine
        release(ctx)
    same = sum(
        first_difference(a, b) for a, b in zip(tokens["eager"], tokens["graphs"], strict=True)
    )
    result["greedy_agree"] = same / sum(len(t) for t in tokens["eager"])
    result["captured"] = ctx.cuda  # False: eager replays (--smoke), not graphs
    for batch in result["eager"]["decode_ms"]:
        eager, graphed = result["eager"]["decode_ms"][batch], result["graphs"]["decode_ms"][batch]
        result[f"speedup_b{batch}"] = eager / graphed
    return result


def weight_bytes_read(model: Any, batch: int) -> int:
    """Weight bytes one decode step reads: every matrix but the embedding table (only the
    batch's rows of it), unless the LM head is the embedding."""
    total = weight_bytes(model)
    embedding = model.model.embed_tokens.weight
    row = embedding.shape[1] * embedding.element_size()
    if not model.config.tie_word_embeddings:
        total -= embedding.numel() * embedding.element_size()
    return int(total + batch * row)


def roofline(ctx: Context, reads: float, engine_ms: float, bare_ms: float) -> dict[str, Any]:
    if not ctx.cuda:
        return dict(NO_CUDA)
    floor_ms = 1e3 * reads / HBM_BYTES_PER_S
    return {
        "bytes_per_step": reads,
        "floor_ms": floor_ms,
        "engine_frac": floor_ms / engine_ms,
        "bare_frac": floor_ms / bare_ms,
    }


def engine_decode_ms(
    ctx: Context, engine: Any, prompts: list[list[int]], comm: list[tuple[float, int]] | None = None
) -> list[float]:
    """ms of each timed engine step once every request is past its prefill (then aborted);
    `comm` (rank 0 of a tensor-parallel engine): each timed step's ms in collectives and their
    count are appended to it."""
    from pdserve.engine.request import SamplingParams

    stats = engine.runner.tp.group.stats if comm is not None else None
    s = ctx.sizes
    params = SamplingParams(max_tokens=s.warmup + s.steps + ENGINE_SLACK_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    started: set[str] = set()
    while len(started) < len(ids):  # chunked prefill: each request samples its first token
        started.update(out.request_id for out in engine.step())
    samples = []
    for step in range(s.warmup + s.steps):
        ctx.sync()
        start = time.perf_counter()
        before = (stats.seconds, stats.calls) if stats is not None else (0.0, 0)
        outputs = engine.step()
        ctx.sync()
        if step >= s.warmup:
            samples.append(1e3 * (time.perf_counter() - start))
            if stats is not None and comm is not None:
                comm.append((1e3 * (stats.seconds - before[0]), stats.calls - before[1]))
        if len(outputs) != len(ids):
            raise RuntimeError(f"a decode step gave {len(outputs)} tokens for {len(ids)} requests")
    for request_id in ids:
        engine.abort_request(request_id)
    return samples


def bare_decode_ms(
    ctx: Context, runner: Any, prompts: list[list[int]], per_seq: int
) -> list[float]:
    """The same batch through `ModelRunner.execute` + argmax, fixed block tables, no engine."""
    from pdserve.model.runner import SequenceChunk

    s = ctx.sizes
    tables = [range(i * per_seq, (i + 1) * per_seq) for i in range(len(prompts))]
    group = max(1, s.prefill_budget // len(prompts[0]))
    tokens: list[int] = []
    for first in range(0, len(prompts), group):
        pairs = zip(prompts[first : first + group], tables[first : first + group], strict=True)
        logits = runner.execute([SequenceChunk(p, 0, t, True) for p, t in pairs])
        tokens += torch.argmax(logits, dim=-1).tolist()
    position = len(prompts[0])
    samples = []
    for step in range(s.warmup + s.steps):
        ctx.sync()
        start = time.perf_counter()
        chunks = [
            SequenceChunk((t,), position, table, True)
            for t, table in zip(tokens, tables, strict=True)
        ]
        tokens = torch.argmax(runner.execute(chunks), dim=-1).tolist()
        ctx.sync()
        if step >= s.warmup:
            samples.append(1e3 * (time.perf_counter() - start))
        position += 1
    return samples


# -- 4. staging -------------------------------------------------------------------------------


def staging(ctx: Context) -> dict[str, Any]:
    s = ctx.sizes
    rows = torch.randint(0, 256, (s.stage_cache_blocks, stage_block_bytes(ctx)), dtype=torch.uint8)
    rows = rows.to(ctx.device)  # random bytes: never time copies of zeros
    kv = rows.view(ctx.dtype).view(s.stage_cache_blocks, *s.stage_block)
    result: dict[str, Any] = {
        "block_bytes": rows.shape[1],
        "block_shape": list(s.stage_block),
        "cache_blocks": rows.shape[0],
        "runs": list(s.stage_runs),
    }
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "pinned": lambda: pinned_copies(ctx, rows),
        "pageable": lambda: pageable_copies(ctx, rows),
        "d2d": lambda: device_copies(ctx, rows),
        "peer": lambda: peer_copies(ctx),
    }
    for name, work in parts.items():
        result[name] = attempt(work) if ctx.cuda else dict(NO_CUDA)
    result["kv_stager"] = attempt(lambda: stager_copies(ctx, kv, rows))
    return result


def stage_block_bytes(ctx: Context) -> int:
    count = 1
    for dim in ctx.sizes.stage_block:
        count *= dim
    return count * torch.empty((), dtype=ctx.dtype).element_size()


def run_ids(ctx: Context, count: int) -> list[int]:
    """`count` distinct block ids, shuffled (blocks of a real request are rarely one run)."""
    generator = torch.Generator().manual_seed(SEED + count)
    ids: list[int] = torch.randperm(ctx.sizes.stage_cache_blocks, generator=generator).tolist()
    return ids[:count]


def event_seconds(ctx: Context, stream: Any, work: Callable[[], object]) -> float:
    """Median seconds of `work` on `stream`, by CUDA events, after one warm-up."""
    ctx.sync()  # the stream sees everything issued before (ids, buffers)
    samples = []
    with torch.cuda.stream(stream):
        work()
        for _ in range(ctx.sizes.repeat):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            work()
            end.record(stream)
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
    return median(samples)


def wall_seconds(ctx: Context, work: Callable[[], object]) -> float:
    """Median wall seconds of `work`, device synchronised, after one warm-up."""
    work()
    samples = []
    for _ in range(ctx.sizes.repeat):
        ctx.sync()
        start = time.perf_counter()
        work()
        ctx.sync()
        samples.append(time.perf_counter() - start)
    return median(samples)


def pinned_copies(ctx: Context, rows: torch.Tensor) -> dict[str, Any]:
    """index_select into a device buffer, then one async copy to pinned host rows on a copy
    stream (and back: pinned -> device buffer -> index_copy_), timed by events on that stream."""
    stream = torch.cuda.Stream(ctx.device)
    biggest = max(ctx.sizes.stage_runs)
    host = torch.empty((biggest, rows.shape[1]), dtype=torch.uint8, pin_memory=True)
    buffer = torch.empty((biggest, rows.shape[1]), dtype=torch.uint8, device=ctx.device)
    figures: dict[str, Any] = {}
    for count in ctx.sizes.stage_runs:
        ids = torch.tensor(run_ids(ctx, count), device=ctx.device)
        out, pinned = buffer[:count], host[:count]

        def to_host(ids: torch.Tensor = ids, out: torch.Tensor = out, pinned: Any = pinned) -> None:
            torch.index_select(rows, 0, ids, out=out)
            pinned.copy_(out, non_blocking=True)

        def to_device(
            ids: torch.Tensor = ids, out: torch.Tensor = out, pinned: Any = pinned
        ) -> None:
            out.copy_(pinned, non_blocking=True)
            rows.index_copy_(0, ids, out)

        d2h = event_seconds(ctx, stream, to_host)
        match = bool(torch.equal(host[count - 1], rows[ids[count - 1]].cpu()))
        h2d = event_seconds(ctx, stream, to_device)
        nbytes = count * rows.shape[1]
        figures[str(count)] = {
            "d2h_gbps": gbps(nbytes, d2h),
            "h2d_gbps": gbps(nbytes, h2d),
            "bytes_match": match,
        }
    return figures


def pageable_copies(ctx: Context, rows: torch.Tensor) -> dict[str, Any]:
    """The baseline: one synchronous `.cpu()` per block (and a pageable row copied back)."""
    figures: dict[str, Any] = {}
    for count in ctx.sizes.stage_runs:
        ids = run_ids(ctx, count)
        host = [torch.randint(0, 256, (rows.shape[1],), dtype=torch.uint8) for _ in ids]

        def to_host(ids: list[int] = ids) -> None:
            for block in ids:
                rows[block].cpu()

        def to_device(ids: list[int] = ids, host: list[torch.Tensor] = host) -> None:
            for block, source in zip(ids, host, strict=True):
                rows[block].copy_(source)

        nbytes = count * rows.shape[1]
        d2h, h2d = wall_seconds(ctx, to_host), wall_seconds(ctx, to_device)
        figures[str(count)] = {"d2h_gbps": gbps(nbytes, d2h), "h2d_gbps": gbps(nbytes, h2d)}
    return figures


def device_copies(ctx: Context, rows: torch.Tensor) -> dict[str, Any]:
    """One large copy on the device, and the biggest run of blocks gathered and scattered
    inside the KV cache (index_select + index_copy_)."""
    nbytes = ctx.sizes.d2d_bytes
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=ctx.device)
    target = torch.empty_like(source)
    stream = torch.cuda.current_stream(ctx.device)
    seconds = event_seconds(ctx, stream, lambda: target.copy_(source))
    count = max(ctx.sizes.stage_runs)
    ids = run_ids(ctx, 2 * count) if 2 * count <= rows.shape[0] else run_ids(ctx, count) * 2
    src = torch.tensor(ids[:count], device=ctx.device)
    dst = torch.tensor(ids[count:], device=ctx.device)
    blocks = event_seconds(ctx, stream, lambda: rows.index_copy_(0, dst, rows.index_select(0, src)))
    return {
        "bytes": nbytes,
        "copy_gbps": gbps(nbytes, seconds),
        "read_write_gbps": gbps(2 * nbytes, seconds),
        "read_write_vs_hbm": 2 * nbytes / seconds / HBM_BYTES_PER_S,
        "blocks": count,
        "blocks_gbps": gbps(count * rows.shape[1], blocks),
    }


def peer_copies(ctx: Context) -> dict[str, Any]:
    if torch.cuda.device_count() < 2:
        return {"skipped": "one visible device"}
    nbytes = ctx.sizes.d2d_bytes // 2
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
    target = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")

    def copy() -> None:
        target.copy_(source, non_blocking=True)
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")

    return {"bytes": nbytes, "gbps": gbps(nbytes, wall_seconds(ctx, copy))}


def stager_copies(ctx: Context, kv: torch.Tensor, rows: torch.Tensor) -> dict[str, Any]:
    """`KVStager.staged(block_ids)` (a context manager yielding host memoryviews) and, where it
    has one, `KVStager.write(block_ids, data)`, when pdserve.model.staging provides them."""
    try:
        module = importlib.import_module("pdserve.model.staging")
    except ImportError as error:
        return {"skipped": f"no pdserve.model.staging ({error})"}
    if not hasattr(module, "KVStager"):
        return {"skipped": "pdserve.model.staging has no KVStager"}
    streams = (
        module.CudaStreams(ctx.device) if ctx.cuda and hasattr(module, "CudaStreams") else None
    )
    try:  # (kv_cache, streams, staging_bytes) as of this writing; else the plain form
        stager = module.KVStager(kv, streams, max(ctx.sizes.stage_runs) * rows.shape[1])
    except TypeError:
        stager = module.KVStager(kv)
    figures: dict[str, Any] = {"copy_stream": streams is not None}
    for count in ctx.sizes.stage_runs:
        figures[str(count)] = stager_run(ctx, stager, rows, run_ids(ctx, count))
    block = run_ids(ctx, 1)[0]
    with stager.staged([block]) as views:
        figures["bytes_match"] = bytes(views[0]) == bytes(rows[block].cpu().numpy().data)
    return figures


def stager_run(ctx: Context, stager: Any, rows: torch.Tensor, ids: list[int]) -> dict[str, Any]:
    nbytes = len(ids) * rows.shape[1]

    def read() -> None:
        with stager.staged(ids) as views:
            if sum(view.nbytes for view in views) != nbytes:
                raise RuntimeError("the staged views do not cover the blocks")

    entry = {"staged_gbps": gbps(nbytes, wall_seconds(ctx, read))}
    if hasattr(stager, "write"):
        data = rows[torch.tensor(ids, device=ctx.device)].cpu().numpy().data.cast("B")

        def write() -> None:
            stager.write(ids, data)

        entry["write_gbps"] = gbps(nbytes, wall_seconds(ctx, write))
    return entry


# -- 5. memory --------------------------------------------------------------------------------


def memory(ctx: Context) -> dict[str, Any]:
    from pdserve.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    model_dir = model_path(ctx)
    before = cuda_memory(ctx)
    start = time.perf_counter()
    config = EngineConfig(
        model=str(model_dir),
        device=str(ctx.device),
        dtype=ctx.sizes.dtype,
        max_num_batched_tokens=ctx.sizes.prefill_budget,
    )
    engine = LLMEngine.from_config(config)
    ctx.sync()
    cache = engine.runner.kv_cache
    result: dict[str, Any] = {
        "start_s": time.perf_counter() - start,
        "max_model_len": engine.max_model_len,
        "num_kv_blocks": engine.kv_cache.num_blocks,
        "block_size": engine.kv_cache.block_size,
        "kv_cache_bytes": cache.numel() * cache.element_size(),
        "kv_bytes_per_token": engine.loaded.model.kv_layout(engine.loaded.dtype).bytes_per_token(),
        "weight_bytes": weight_bytes(engine.loaded.model),
        "kv_plan": describe(engine, "kv_plan"),
        "memory": describe(engine, "memory"),
        "cuda_before": before,
        "cuda_after": cuda_memory(ctx),
    }
    result["llama3_8b_arithmetic"] = llama3_8b_arithmetic(ctx)
    return result


def describe(engine: Any, name: str) -> Any:
    if not hasattr(engine, name):
        return {"skipped": f"the engine has no {name}"}
    value = getattr(engine, name)
    if value is None:
        return {"skipped": f"engine.{name} is None"}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return repr(value)


def cuda_memory(ctx: Context) -> dict[str, Any]:
    if not ctx.cuda:
        return dict(NO_CUDA)
    free, total = torch.cuda.mem_get_info(ctx.device)
    return {
        "free_bytes": free,
        "total_bytes": total,
        "allocated_bytes": torch.cuda.memory_allocated(ctx.device),
        "reserved_bytes": torch.cuda.memory_reserved(ctx.device),
        "max_allocated_bytes": torch.cuda.max_memory_allocated(ctx.device),
    }


def llama3_8b_arithmetic(ctx: Context) -> dict[str, Any]:
    """Arithmetic, not a measurement: full Llama-3-8B bf16 weights and the KV tokens that 90%
    of this device's memory would hold beside them."""
    if not ctx.cuda:
        return dict(NO_CUDA)
    a = LLAMA3_8B
    hidden, kv_dim = a["hidden_size"], a["num_key_value_heads"] * a["head_dim"]
    layer = 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * a["intermediate_size"]
    params = LLAMA3_8B_LAYERS * (layer + 2 * hidden) + 2 * a["vocab_size"] * hidden + hidden
    kv_per_token = LLAMA3_8B_LAYERS * 2 * kv_dim * 2
    _, total = torch.cuda.mem_get_info(ctx.device)
    return {
        "params": params,
        "weight_bytes": 2 * params,
        "kv_bytes_per_token": kv_per_token,
        "kv_tokens_in_90pct": int((0.9 * total - 2 * params) // kv_per_token),
    }


# -- 6. tensor parallel -----------------------------------------------------------------------


def tensor_parallel(ctx: Context) -> dict[str, Any]:
    """A TP=2 engine (rank 1 on the next GPU) against a TP=1 engine on the same weights and
    prompts, both eager (CUDA graphs are off for TP). `--smoke` on CPU: both ranks on CPU."""
    first = ctx.device.index or 0
    gpus = torch.cuda.device_count() if ctx.cuda else 0
    if ctx.cuda and gpus < first + TP_SIZE:
        where = "" if first == 0 else f" from cuda:{first} on"
        return {"skipped": f"needs {TP_SIZE} GPUs{where}, found {gpus}"}
    if not ctx.cuda and not ctx.args.smoke:
        return {"skipped": f"needs {TP_SIZE} GPUs, found {gpus}"}
    s = ctx.sizes
    vocab = int(s.arch["vocab_size"])
    logit_prompts = random_prompts(s.prompts, s.prompt_len, vocab, SEED + 1)
    greedy_prompts = random_prompts(8, 64, vocab, seed=7)
    ranks = [f"cuda:{first + r}" if ctx.cuda else "cpu" for r in range(TP_SIZE)]
    result: dict[str, Any] = {
        "ranks": ranks,
        "backend": "nccl" if ctx.cuda else "gloo",
        "cuda_graphs": False,
        "gpus": gpus,
    }
    logits: dict[int, torch.Tensor] = {}
    tokens: dict[int, list[list[int]]] = {}
    for size in (1, TP_SIZE):
        figures, logits[size], tokens[size] = tp_engine_figures(
            ctx, size, logit_prompts, greedy_prompts
        )
        result[f"tp{size}"] = figures
        log(ctx, f"tensor_parallel: TP={size}: {figures['decode_ms']} ms per step")
    one, many = logits[1], logits[TP_SIZE]
    result["logit_maxdiff"] = float((many - one).abs().max())
    result["logit_absmax"] = float(one.abs().max())
    result["top1_agree"] = float((many.argmax(-1) == one.argmax(-1)).float().mean())
    firsts = [first_difference(a, b) for a, b in zip(tokens[1], tokens[TP_SIZE], strict=True)]
    result["greedy_agree"] = sum(firsts) / sum(len(t) for t in tokens[1])
    result["first_divergence"] = firsts
    result["exact"] = tokens[1] == tokens[TP_SIZE]
    for batch in result["tp1"]["tok_s"]:
        ratio = result[f"tp{TP_SIZE}"]["tok_s"][batch] / result["tp1"]["tok_s"][batch]
        result[f"tok_s_ratio_b{batch}"] = ratio
    return result


def tp_engine_figures(
    ctx: Context, size: int, logit_prompts: list[list[int]], greedy_prompts: list[list[int]]
) -> tuple[dict[str, Any], torch.Tensor, list[list[int]]]:
    """One engine's figures (`size` ranks), the last-position prefill logits of
    `logit_prompts` (on the host) and the greedy tokens of `greedy_prompts`. The engine is
    closed at the end (its workers stopped) whatever happens."""
    from pdserve.engine.request import SamplingParams
    from pdserve.model.runner import SequenceChunk

    s = ctx.sizes
    start = time.perf_counter()
    engine = decode_engine(
        ctx,
        cuda_graphs=False,
        tensor_parallel_size=size,
        tp_timeout_s=60.0,
        torch_threads=ctx.args.threads,  # the worker's too
    )
    try:
        ctx.sync()
        figures: dict[str, Any] = {"start_s": time.perf_counter() - start}
        per_seq = blocks_for(len(logit_prompts[0]) + 1)  # a fresh engine: no block is in use
        chunks = [
            SequenceChunk(p, 0, range(i * per_seq, (i + 1) * per_seq), True)
            for i, p in enumerate(logit_prompts)
        ]
        logits = engine.runner.execute(chunks).float().cpu()
        figures |= {"decode_ms": {}, "tok_s": {}}
        if size > 1:
            figures |= {"comm_ms": {}, "compute_ms": {}, "collectives_per_step": {}}
        for batch in (min(s.batches), max(s.batches)):
            prompts = random_prompts(batch, s.decode_prompt_len, int(s.arch["vocab_size"]), batch)
            comm: list[tuple[float, int]] = []
            ms = median(engine_decode_ms(ctx, engine, prompts, comm if size > 1 else None))
            figures["decode_ms"][str(batch)] = ms
            figures["tok_s"][str(batch)] = 1e3 * batch / ms
            if size > 1:
                comm_ms = median([c for c, _ in comm])
                figures["comm_ms"][str(batch)] = comm_ms
                figures["compute_ms"][str(batch)] = ms - comm_ms
                figures["collectives_per_step"][str(batch)] = median([n for _, n in comm])
        params = SamplingParams(max_tokens=s.greedy_tokens, ignore_eos=True)
        tokens = [list(c.token_ids) for c in engine.generate(greedy_prompts, params)]
        if size > 1:
            figures["kv_round_trip"] = tp_kv_round_trip(engine)
        return figures, logits, tokens
    finally:
        engine.close()
        del engine
        release(ctx)


def tp_kv_round_trip(engine: Any) -> dict[str, Any]:
    """Rank 0's sliced view of the ranks' KV caches (CUDA: the workers' mapped over CUDA IPC):
    random bytes written into 4 free blocks read back equal, whole and rank by rank, and a
    copy-out of them (storage write-back) equals them too."""
    stager = engine.runner.stager
    blocks = [1, 2, 5, 6]  # the prompts above finished: no request holds a block
    data = torch.randint(0, 256, (len(blocks), stager.block_bytes), dtype=torch.uint8)
    start = time.perf_counter()
    stager.write(blocks, memoryview(data.numpy().tobytes()))
    write_s = time.perf_counter() - start
    with stager.staged(blocks) as views:
        whole = all(bytes(v) == data[i].numpy().tobytes() for i, v in enumerate(views))
    width, ranks_equal = stager.block_bytes // len(stager.slices), True
    for rank, part in enumerate(stager.slices):
        with part.staged(blocks) as views:
            expected = data[:, rank * width : (rank + 1) * width]
            ranks_equal &= all(
                bytes(v) == expected[i].numpy().tobytes() for i, v in enumerate(views)
            )
    copy = stager.copy_out(blocks)
    copied = copy is not None and all(
        bytes(v) == data[i].numpy().tobytes() for i, v in enumerate(copy.views)
    )
    return {
        "ranks": len(stager.slices),
        "whole_equal": whole,
        "ranks_equal": ranks_equal,
        "copy_out_equal": copied,
        "write_gbps": data.numel() / write_s / 1e9,
    }


# -- driver -----------------------------------------------------------------------------------


def cuda_ipc(ctx: Context) -> dict[str, Any]:
    """`CudaIpcKVTransport` between two processes (one GPU, and two when visible): a child
    exports a KV cache as a decode instance does, this process maps it and copies blocks in
    (`benchmarks/_cuda_ipc_check.py`), bytes verified by the child."""
    if not ctx.cuda:
        return dict(NO_CUDA)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _cuda_ipc_check import exercise_cuda_ipc

    return exercise_cuda_ipc(timeout_s=80.0)


# -- 9. the other families: Qwen3, Qwen3-MoE, Mixtral ----------------------------------------

# Shapes of a real member of each family (fewer layers: `FAMILY_LAYERS`), and `--smoke`'s.
FAMILIES: dict[str, dict[str, Any]] = {
    "Qwen3ForCausalLM": {  # Qwen3-8B
        "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    },
    "Qwen3MoeForCausalLM": {  # Qwen3-30B-A3B
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "vocab_size": 151936,
    },
    "MixtralForCausalLM": {  # Mixtral-8x7B
        "hidden_size": 4096, "intermediate_size": 14336, "num_local_experts": 8,
        "num_experts_per_tok": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 32000,
    },
    "DeepseekV3ForCausalLM": {  # DeepSeek-V3's attention and experts, 64 of its 256 experts
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "n_routed_experts": 64, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
        "topk_group": 4, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
        "num_attention_heads": 128, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "vocab_size": 129280, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
    },
}  # fmt: skip
SMOKE_FAMILY = {  # every key of FAMILIES, at smoke sizes
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_experts": 8,
    "num_local_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 32000,
    "n_routed_experts": 8, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
    "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "kv_lora_rank": 64,
    "q_lora_rank": 96, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
    "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 1024,
    },
}  # fmt: skip
FAMILY_LAYERS = 2
MOE_KERNEL_TOKENS = (1, 64, 512)
LATENT_CASES = {False: ((1, 4096), (32, 1024), (128, 2048)), True: ((1, 40), (4, 100))}


def families(ctx: Context) -> dict[str, Any]:
    """Per family: a random checkpoint written by `transformers` in the run's dtype (routers'
    weights drawn wide, as the CPU tests do, so that routes do not hang on rounding), greedy
    tokens of `LLMEngine` against `generate`, ms per decode step at the smallest and largest
    batch; for the mixture-of-experts families the fused Triton experts (`triton_moe`) against
    the grouped reference path on the first layer's experts: max difference and ms."""
    result: dict[str, Any] = {}
    for architecture in FAMILIES:
        result[architecture] = attempt(lambda a=architecture: family_figures(ctx, a))
        release(ctx)
    return result


def family_figures(ctx: Context, architecture: str) -> dict[str, Any]:
    import transformers

    s = ctx.sizes
    shape = FAMILIES[architecture]
    if ctx.args.smoke:  # the family's own keys, at smoke sizes
        shape = {key: SMOKE_FAMILY[key] for key in shape}
    if "kv_lora_rank" in shape:  # latent attention: as many KV "heads" as heads
        shape = {**shape, "num_key_value_heads": shape["num_attention_heads"]}
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    config = config_class(
        **shape, num_hidden_layers=FAMILY_LAYERS, max_position_embeddings=4096, **REFERENCE_SETTINGS
    )
    torch.manual_seed(SEED)
    with default_dtype(ctx.dtype), ctx.device:
        reference = getattr(transformers, architecture)(config).eval()
        with torch.no_grad():
            for name, parameter in reference.named_parameters():
                if name.endswith("gate.weight"):
                    parameter.normal_(0.0, 0.5)
    path = ctx.work / architecture
    reference.save_pretrained(path)
    write_tokenizer(path, int(shape["vocab_size"]))
    reference.generation_config.eos_token_id = None
    vocab = int(shape["vocab_size"])
    prompts = random_prompts(s.prompts, s.prompt_len, vocab, SEED)
    figures: dict[str, Any] = {
        "params": sum(p.numel() for p in reference.parameters()),
        "layers": FAMILY_LAYERS,
    }
    figures["greedy"] = attempt(functools.partial(greedy_agreement, ctx, reference, path, prompts))
    del reference
    release(ctx)
    engine = family_engine(ctx, path)
    figures["decode_ms"] = {
        str(batch): median(
            engine_decode_ms(ctx, engine, random_prompts(batch, s.decode_prompt_len, vocab, batch))
        )
        for batch in (min(s.batches), max(s.batches))
    }
    if engine.loaded.config.moe is not None:
        figures["fused_moe"] = attempt(lambda: fused_moe_check(ctx, engine.loaded.model))
    if engine.loaded.config.mla is not None:
        figures["latent_decode"] = attempt(lambda: latent_decode_check(ctx, engine))
    log(ctx, f"families: {architecture}: {figures['decode_ms']} ms per step")
    return figures


def latent_decode_check(ctx: Context, engine: Any) -> dict[str, Any]:
    """The engine's latent-attention decode (the Triton kernel on CUDA, pdserve's C++ one on
    CPU) against the torch reference on one layer of random latents in place in a paged cache,
    at the model's heads and latent width: max difference, relative to the output's scale, and
    ms of each, per batch x context."""
    from pdserve.model.attention import AttentionMetadata, latent_decode_reference

    mla, heads = engine.loaded.config.mla, engine.loaded.config.num_heads
    figures: dict[str, Any] = {}
    for batch, context in LATENT_CASES[ctx.args.smoke]:
        per_seq = blocks_for(context)
        generator = torch.Generator(device=ctx.device).manual_seed(SEED)
        cache = torch.randn(
            batch * per_seq, 2, 1, BLOCK_SIZE, 1, mla.latent_dim,
            generator=generator, device=ctx.device, dtype=ctx.dtype,
        )  # fmt: skip
        layer = cache[:, 1]  # a strided layer view, as the engine's
        q = torch.randn(batch, heads, mla.latent_dim, device=ctx.device, dtype=ctx.dtype)
        tables = torch.arange(batch * per_seq, device=ctx.device).view(batch, per_seq)
        lens = torch.full((batch,), context, device=ctx.device, dtype=torch.long)
        meta = AttentionMetadata(
            slot_blocks=tables[:, -1], slot_offsets=(lens - 1) % BLOCK_SIZE,
            query_lens=[1] * batch, context_lens=[context] * batch, block_tables=tables,
            context_lens_tensor=lens, decode_only=True,
        )  # fmt: skip
        step = engine.loaded.model.attention.plan(meta)
        kernel = functools.partial(step.latent_decode, q, layer, mla.scale, mla.kv_lora_rank)
        reference = functools.partial(
            latent_decode_reference, q, layer, tables, lens, mla.scale, mla.kv_lora_rank
        )
        ours, theirs = kernel().float(), reference().float()
        figures[f"b{batch}_ctx{context}"] = {
            "maxdiff": float((ours - theirs).abs().max()),
            "absmax": float(theirs.abs().max()),
            "kernel_ms": median(timed_ms(ctx, kernel)),
            "reference_ms": median(timed_ms(ctx, reference, repeat=3)),
        }
    return figures


# -- FP8 KV cache ---------------------------------------------------------------------------


def fp8_kv(ctx: Context) -> dict[str, Any]:
    """The correctness model with an FP8 KV cache against the same model's full-precision one:
    KV bytes per token of each; prefill logits of the correctness prompts (last position) and
    their largest difference relative to the logits' scale; greedy tokens of both engines and
    how many agree; ms per decode step of each at the smallest and largest batch."""
    from pdserve.engine.request import SamplingParams
    from pdserve.model.runner import ModelRunner, SequenceChunk

    s = ctx.sizes
    vocab = int(s.arch["vocab_size"])
    prompts = random_prompts(s.prompts, s.prompt_len, vocab, SEED)
    figures: dict[str, Any] = {"decode_ms": {}}
    tokens: dict[str, list[list[int]]] = {}
    logits: dict[str, torch.Tensor] = {}
    for dtype in ("auto", "fp8_e4m3"):
        engine = decode_engine(ctx, kv_cache_dtype=dtype)
        loaded = engine.loaded
        figures[f"kv_bytes_per_token_{dtype}"] = loaded.model.kv_layout(
            loaded.dtype
        ).bytes_per_token()
        per_seq = blocks_for(s.prompt_len)
        runner = ModelRunner.create(loaded.model, len(prompts) * per_seq, BLOCK_SIZE, loaded.dtype)
        chunks = [
            SequenceChunk(p, 0, range(i * per_seq, (i + 1) * per_seq), True)
            for i, p in enumerate(prompts)
        ]
        logits[dtype] = runner.execute(chunks).float()
        del runner
        greedy = SamplingParams(max_tokens=s.greedy_tokens, ignore_eos=True)
        tokens[dtype] = [list(c.token_ids) for c in engine.generate(prompts, greedy)]
        figures["decode_ms"][dtype] = {
            str(batch): median(
                engine_decode_ms(
                    ctx, engine, random_prompts(batch, s.decode_prompt_len, vocab, batch)
                )
            )
            for batch in (min(s.batches), max(s.batches))
        }
        if dtype != "auto" and loaded.model.kv_scales is not None:
            figures["scales"] = loaded.model.kv_scales.source
        del engine, loaded
        release(ctx)
    delta = (logits["fp8_e4m3"] - logits["auto"]).abs()
    firsts = [
        first_difference(a, b) for a, b in zip(tokens["auto"], tokens["fp8_e4m3"], strict=True)
    ]
    figures |= {
        "logit_maxdiff": float(delta.max()),
        "logit_meandiff": float(delta.mean()),
        "logit_reldiff": float(delta.max() / logits["auto"].abs().max()),
        "argmax_agree": float(
            (logits["fp8_e4m3"].argmax(-1) == logits["auto"].argmax(-1)).float().mean()
        ),
        "greedy_agree": sum(firsts) / (s.greedy_tokens * len(prompts)),
        "first_divergence": firsts,
    }
    return figures


def family_engine(ctx: Context, path: Path) -> Any:
    from pdserve.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    s = ctx.sizes
    biggest = max(s.batches)
    config = EngineConfig(
        model=str(path),
        device=str(ctx.device),
        dtype=s.dtype,
        block_size=BLOCK_SIZE,
        num_kv_blocks=biggest * decode_blocks_per_seq(ctx) + 16,
        max_num_seqs=biggest,
        max_num_batched_tokens=s.prefill_budget,
    )
    return LLMEngine.from_config(config)


def fused_moe_check(ctx: Context, model: Any) -> dict[str, Any]:
    """The first sparse layer's experts on random rows routed by its own router: the fused
    Triton kernel against the grouped per-expert path (both on the device)."""
    if not ctx.cuda:
        return dict(NO_CUDA)
    from pdserve.model.moe import SparseMoE, route
    from pdserve.model.triton_moe import fused_experts

    block = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE))
    experts, moe = block.experts, block.moe
    figures: dict[str, Any] = {}
    for tokens in MOE_KERNEL_TOKENS:
        x = torch.randn(tokens, experts.gate_up.shape[2], device=ctx.device, dtype=ctx.dtype)
        weights, ids = route(block.gate(x), moe.top_k, moe.normalize_top_k)
        fused = fused_experts(x, experts.gate_up, experts.down, ids, weights, experts.part.first)
        grouped = experts._grouped(x, ids, weights)

        def run_fused(x: torch.Tensor = x, ids: Any = ids, weights: Any = weights) -> object:
            return fused_experts(x, experts.gate_up, experts.down, ids, weights, experts.part.first)

        def run_grouped(x: torch.Tensor = x, ids: Any = ids, weights: Any = weights) -> object:
            return experts._grouped(x, ids, weights)

        figures[str(tokens)] = {
            "maxdiff": float((fused.float() - grouped.float()).abs().max()),
            "absmax": float(grouped.float().abs().max()),
            "fused_ms": median(timed_ms(ctx, run_fused)),
            "grouped_ms": median(timed_ms(ctx, run_grouped)),
        }
    return figures


def timed_ms(ctx: Context, work: Callable[[], object], repeat: int = 10) -> list[float]:
    work()
    samples = []
    for _ in range(repeat):
        ctx.sync()
        start = time.perf_counter()
        work()
        ctx.sync()
        samples.append(1e3 * (time.perf_counter() - start))
    return samples


SECTIONS: tuple[tuple[str, Callable[[Context], dict[str, Any]], float], ...] = (
    ("environment", environment, 30.0),
    ("correctness", correctness, 150.0),
    ("decode", decode, 150.0),
    ("cuda_graphs", cuda_graphs, 120.0),
    ("staging", staging, 60.0),
    ("cuda_ipc", cuda_ipc, 90.0),
    ("memory", memory, 60.0),
    ("tensor_parallel", tensor_parallel, 120.0),
    ("families", families, 300.0),
    ("fp8_kv", fp8_kv, 150.0),
)


class SectionTimeout(BaseException):
    """Raised by SIGALRM in a section that outran its limit (not an Exception: `attempt` lets
    it through)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def fire(signum: int, frame: FrameType | None) -> None:
        raise SectionTimeout(f"over its {seconds:.0f} s limit")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_section(
    ctx: Context, name: str, work: Callable[[Context], dict[str, Any]], limit: float
) -> dict[str, Any]:
    left = ctx.deadline - time.perf_counter()
    if left < MIN_SECTION_S:
        return {"skipped": f"time budget spent ({left:.0f} s left)"}
    limit = min(limit * ctx.args.limit_scale, left)
    log(ctx, f"{name}: start (limit {limit:.0f} s)")
    start = time.perf_counter()
    try:
        with time_limit(limit):
            result = work(ctx)
    except (Exception, SectionTimeout) as error:
        result = {
            "error": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exc()[-3000:],
        }
    result["seconds"] = time.perf_counter() - start
    release(ctx)
    state = "error: " + result["error"] if "error" in result else "done"
    log(ctx, f"{name}: {state} ({result['seconds']:.1f} s)")
    return result


def dig(results: Mapping[str, Any], *path: str) -> Any:
    value: Any = results
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def headline(ctx: Context, results: Mapping[str, Any]) -> dict[str, float | None]:
    s = ctx.sizes
    low, high, run = str(min(s.batches)), str(max(s.batches)), str(max(s.stage_runs))
    variance = [
        dig(results, "correctness", "batch_variance", k)
        for k in ("prefill_maxdiff", "decode_maxdiff")
    ]
    pinned, pageable = (
        dig(results, "staging", "pinned", run, "d2h_gbps"),
        dig(results, "staging", "pageable", run, "d2h_gbps"),
    )
    return {
        "load_peak_ratio": dig(results, "correctness", "load", "peak", "load_peak_ratio"),
        "logit_maxdiff": dig(results, "correctness", "prefill", "logit_maxdiff"),
        "greedy_agree": dig(results, "correctness", "greedy", "greedy_agree"),
        "batch_maxdiff": None if None in variance else max(v for v in variance if v is not None),
        f"decode_ms_b{low}": dig(results, "decode", "batches", low, "engine_ms"),
        f"decode_ms_b{high}": dig(results, "decode", "batches", high, "engine_ms"),
        f"bare_ms_b{high}": dig(results, "decode", "batches", high, "bare_ms"),
        f"roofline_frac_b{high}": dig(
            results, "decode", "batches", high, "roofline", "engine_frac"
        ),
        "graphs_agree": dig(results, "cuda_graphs", "greedy_agree"),
        f"graphs_speedup_b{low}": dig(results, "cuda_graphs", f"speedup_b{low}"),
        f"graphs_speedup_b{high}": dig(results, "cuda_graphs", f"speedup_b{high}"),
        "stage_d2h_gbps": pinned,
        "stage_h2d_gbps": dig(results, "staging", "pinned", run, "h2d_gbps"),
        "stage_vs_pageable": pinned / pageable if pinned and pageable else None,
        "stager_gbps": dig(results, "staging", "kv_stager", run, "staged_gbps"),
        "d2d_gbps": dig(results, "staging", "d2d", "copy_gbps"),
        "kv_blocks": dig(results, "memory", "num_kv_blocks"),
        **ipc_headline(results.get("cuda_ipc")),
        "tp_greedy_agree": dig(results, "tensor_parallel", "greedy_agree"),
        "tp_kv_round_trip": dig(
            results, "tensor_parallel", f"tp{TP_SIZE}", "kv_round_trip", "ranks_equal"
        ),
        f"tp_tok_s_ratio_b{low}": dig(results, "tensor_parallel", f"tok_s_ratio_b{low}"),
        f"tp_tok_s_ratio_b{high}": dig(results, "tensor_parallel", f"tok_s_ratio_b{high}"),
        f"tp_comm_ms_b{high}": dig(results, "tensor_parallel", f"tp{TP_SIZE}", "comm_ms", high),
        **family_headline(results.get("families"), low, high),
        "fp8_kv_bytes_ratio": fp8_ratio(results),
        "fp8_logit_reldiff": dig(results, "fp8_kv", "logit_reldiff"),
        "fp8_greedy_agree": dig(results, "fp8_kv", "greedy_agree"),
        f"fp8_decode_ms_b{high}": dig(results, "fp8_kv", "decode_ms", "fp8_e4m3", high),
        f"fp8_speedup_b{high}": fp8_speedup(results, high),
    }


def fp8_ratio(results: Mapping[str, Any]) -> float | None:
    """An FP8 cache's bytes per token over the full-precision one's."""
    fp8, full = (dig(results, "fp8_kv", f"kv_bytes_per_token_{d}") for d in ("fp8_e4m3", "auto"))
    return fp8 / full if fp8 and full else None


def fp8_speedup(results: Mapping[str, Any], batch: str) -> float | None:
    """Decode steps with the full-precision cache over with the FP8 one (above 1: FP8 faster)."""
    fp8, full = (dig(results, "fp8_kv", "decode_ms", d, batch) for d in ("fp8_e4m3", "auto"))
    return full / fp8 if fp8 and full else None


def family_headline(families: object, low: str, high: str) -> dict[str, float | None]:
    """Per family (short names): greedy agreement, decode ms, the fused MoE kernel's largest
    difference relative to the output scale and its speedup over the grouped path at 512 rows."""
    metrics: dict[str, float | None] = {}
    for architecture in FAMILIES:
        short = architecture.removesuffix("ForCausalLM").lower()
        figures = families.get(architecture, {}) if isinstance(families, Mapping) else {}
        metrics[f"{short}_greedy_agree"] = dig(figures, "greedy", "greedy_agree")
        metrics[f"{short}_decode_ms_b{low}"] = dig(figures, "decode_ms", low)
        metrics[f"{short}_decode_ms_b{high}"] = dig(figures, "decode_ms", high)
        if any(name in architecture for name in ("Moe", "Mixtral", "Deepseek")):
            big = str(MOE_KERNEL_TOKENS[-1])
            diff, scale = (dig(figures, "fused_moe", big, k) for k in ("maxdiff", "absmax"))
            fused, grouped = (dig(figures, "fused_moe", big, k) for k in ("fused_ms", "grouped_ms"))
            metrics[f"{short}_fused_moe_reldiff"] = (
                diff / scale if diff is not None and scale else None
            )
            metrics[f"{short}_fused_moe_speedup"] = grouped / fused if fused and grouped else None
        if "Deepseek" in architecture:
            case = "b128_ctx2048" if high != "4" else "b4_ctx100"
            diff, scale = (dig(figures, "latent_decode", case, k) for k in ("maxdiff", "absmax"))
            kernel, ref = (
                dig(figures, "latent_decode", case, k) for k in ("kernel_ms", "reference_ms")
            )
            metrics[f"{short}_latent_reldiff"] = (
                diff / scale if diff is not None and scale else None
            )
            metrics[f"{short}_latent_kernel_ms"] = kernel
            metrics[f"{short}_latent_speedup"] = ref / kernel if kernel and ref else None
    return metrics


def ipc_headline(ipc: object) -> dict[str, float | None]:
    """`cuda_ipc_ok` (1/0) and the same-GPU pair's GB/s of its one-run copy."""
    if not isinstance(ipc, Mapping) or "ok" not in ipc:
        return {"cuda_ipc_ok": None, "cuda_ipc_gbps": None}
    pairs = ipc.get("pairs") or [{}]
    rounds = pairs[0].get("rounds", {})
    first = next(iter(rounds.values()), {}) if isinstance(rounds, Mapping) else {}
    return {"cuda_ipc_ok": float(bool(ipc["ok"])), "cuda_ipc_gbps": first.get("gbps_median")}


def write_document(
    path: Path, ctx: Context, results: Mapping[str, Any], metrics: Mapping[str, float | None]
) -> None:
    document = {
        "benchmark": NAME,
        "metrics": dict(metrics),
        "results": dict(results),
        "args": vars(ctx.args),
        "machine": machine_info(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")


def print_summary(
    ctx: Context, results: Mapping[str, Any], metrics: Mapping[str, float | None]
) -> None:
    def status(result: Mapping[str, Any]) -> str:
        return "error" if "error" in result else ("skipped" if "skipped" in result else "ok")

    sections = [[n, status(r), float(r.get("seconds", 0.0))] for n, r in results.items()]
    print_table("sections", ["section", "status", "seconds"], sections)
    rows: list[list[str | int | float]] = []
    for batch in ctx.sizes.batches:
        figures = results.get("decode", {}).get("batches", {}).get(str(batch))
        if figures is not None:
            frac = dig(figures, "roofline", "engine_frac")
            rows.append([batch, figures["engine_ms"], figures["bare_ms"], figures["overhead_ms"]])
            rows[-1].append("na" if frac is None else frac)
    if rows:
        headers = ["batch", "engine ms", "bare ms", "overhead ms", "roofline frac"]
        print_table("decode step", headers, rows)
    values = [[key, "na" if value is None else value] for key, value in metrics.items()]
    print_table("headline", ["key", "value"], values)


def output_path(args: argparse.Namespace) -> Path:
    name = f"{NAME}_smoke.json" if args.smoke else f"{NAME}.json"
    if args.out is not None:
        return Path(args.out)
    if args.out_dir is not None:
        return Path(args.out_dir) / name
    if args.smoke:  # committed results are GPU runs only
        return Path(tempfile.gettempdir()) / name
    return RESULTS_DIR / name


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or NAME).split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU): does it run?")
    parser.add_argument("--out", default=None, help="JSON path (default: see the docstring)")
    parser.add_argument("--out-dir", default=None, help=f"write {NAME}.json into this folder")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (4; smoke 2)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="the whole run's budget")
    parser.add_argument("--limit-scale", type=float, default=1.0, help="x each section's limit")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--commit", default=None, help="pdserve commit (default: git rev-parse)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if importlib.util.find_spec("pdserve") is None:  # run from a checkout without installing
        sys.path.insert(0, str(ROOT))
        # and the tensor-parallel workers (child processes) import it from there too
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
        )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sizes = SMOKE if args.smoke else FULL
    if args.layers is not None:
        sizes = dataclasses.replace(sizes, layers=args.layers)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    out = output_path(args)
    started = time.perf_counter()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-gpu-check-") as work:
        ctx = Context(args, sizes, device, Path(work), started, started + args.budget_s)
        log(ctx, f"gpu_check on {device} ({sizes.dtype}, {sizes.layers} layers), writing {out}")
        for name, section, limit in SECTIONS:
            results[name] = run_section(ctx, name, section, limit)
            write_document(out, ctx, results, headline(ctx, results))
    metrics = headline(ctx, results)
    print_summary(ctx, results, metrics)
    write_document(out, ctx, results, metrics)
    print(f"\nwrote {out}")
    values = " ".join(f"{k}={'na' if v is None else format_value(v)}" for k, v in metrics.items())
    print(f"RESULT {NAME} {values}", flush=True)


if __name__ == "__main__":
    main()

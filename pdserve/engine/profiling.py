"""The start's profiling pass: synthetic batches that seed the step time model
(`pdserve.engine.perf_model`), and the fits kept between starts.

Before an instance serves, its engine runs prompts of random token ids shaped to span what it
will see: single prompts of growing length (prefill), batches of growing size decoding over a
short and a long context (decode), and a long prompt joining a decoding batch (mixed), until
they are done or `budget_s` is spent. Nothing of them stays: prefix caching is off while they
run (no block published, no KV event, nothing written to the storage tier) and the engine's
counters are put back. The fit is saved under the cache directory, keyed by what decides step
times (the model's config and weights' size, device, dtype, attention backend, threads, batch
limits, tensor parallelism); the next start with the same key loads it instead of profiling.
Every served step refines it.
"""

import dataclasses
import hashlib
import json
import logging
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from platformdirs import user_cache_dir

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import SamplingParams

logger = logging.getLogger(__name__)

CACHE_VARIABLE = "PDSERVE_STEP_TIME_CACHE"  # where fits are saved (default: the user cache)
DECODE_TOKENS = 8  # tokens each decode scenario's requests generate


def fit_key(config: EngineConfig, engine: LLMEngine) -> str:
    """What decides the engine's step times, hashed."""
    loaded = engine.loaded
    model = loaded.path
    weights = sum(p.stat().st_size for p in sorted(model.glob("*.safetensors")))
    parts = {
        "model_config": (model / "config.json").read_text(),
        "weights_bytes": weights,
        "device": str(loaded.device),
        "device_name": torch.cuda.get_device_name() if loaded.device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        **{name: str(getattr(config, name)) for name in (
            "dtype", "kv_cache_dtype", "block_size", "attention_backend", "max_num_seqs",
            "max_num_batched_tokens", "tensor_parallel_size", "expert_parallel_size",
            "cuda_graphs",
        )},
    }  # fmt: skip
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def fit_path(key: str) -> Path:
    default = Path(user_cache_dir("pdserve")) / "step-time"
    return Path(os.environ.get(CACHE_VARIABLE, default)) / f"{key}.json"


def seed_step_time(engine: LLMEngine, config: EngineConfig) -> str:
    """Load the saved fit for this engine, or profile it (at most `config.step_profile_s`)
    and save the fit; returns what was done (for the start's log)."""
    path = fit_path(fit_key(config, engine))
    try:
        if engine.step_time.load(json.loads(path.read_text())):
            return f"step time model loaded from {path}"
    except (OSError, ValueError, TypeError):
        pass  # none saved, or unreadable or not a fit: profile
    if config.step_profile_s <= 0:
        return "step time model: no profiling pass (engine.step_profile_s is 0)"
    started = time.perf_counter()
    steps = profile(engine, config.step_profile_s)
    _save(path, engine.step_time.state())
    return (
        f"step time model profiled: {steps} steps in {time.perf_counter() - started:.1f} s, "
        f"saved to {path}"
    )


def profile(engine: LLMEngine, budget_s: float, seed: int = 0) -> int:
    """Run the synthetic scenarios until done or `budget_s` is spent (the requests running
    then are stopped; engine thread, before it serves: nothing else may be queued); returns
    the steps run."""
    cache = engine.kv_cache
    stats, caching = dataclasses.replace(engine.scheduler.stats), cache.enable_prefix_caching
    steps_before = engine.step_time.samples
    cache.enable_prefix_caching = False
    deadline = time.perf_counter() + budget_s
    rng = random.Random(seed)
    vocab = engine.loaded.config.vocab_size
    last_step = 0.0  # a step may not start unless one like the last still fits the budget
    try:
        for batch in _scenarios(engine):
            if time.perf_counter() + last_step >= deadline:
                break
            for length, tokens in batch:
                prompt = [rng.randrange(vocab) for _ in range(length)]
                params = SamplingParams(max_tokens=tokens, ignore_eos=True)
                engine.add_request(prompt, params, f"profile-{rng.getrandbits(64):016x}")
            while engine.has_unfinished_requests():
                started = time.perf_counter()
                if started + last_step >= deadline:
                    break
                engine.step()
                last_step = time.perf_counter() - started
    finally:
        for request_id in list(engine.scheduler.requests):  # cut short by the budget
            engine.stop_computing(request_id)
        engine.add_text([])  # their ends reach the output processor
        cache.enable_prefix_caching = caching
        engine.scheduler.stats = stats
    return engine.step_time.samples - steps_before


def _scenarios(engine: LLMEngine) -> Iterator[list[tuple[int, int]]]:
    """Batches of (prompt tokens, tokens to generate), cheapest first."""
    limits = engine.scheduler.config
    room = engine.kv_cache.num_blocks * engine.block_size * 3 // 4  # KV tokens a batch may hold
    longest = max(16, min(2 * limits.max_num_batched_tokens, engine.max_model_len // 2, room))
    length = 16
    while length <= longest:  # prefill: one prompt
        yield [(length, 1)]
        length *= 4
    for context in (32, max(32, min(1024, engine.max_model_len // 4, room // 4))):
        for size in (1, 4, 16, limits.max_num_seqs):  # decode: a batch over `context`
            rows = max(1, min(size, limits.max_num_seqs, room // (context + DECODE_TOKENS)))
            yield [(context, DECODE_TOKENS)] * rows
    rows = max(1, min(limits.max_num_seqs // 2, room // (2 * (32 + DECODE_TOKENS))))
    yield [(32, DECODE_TOKENS)] * rows + [(min(longest, room // 2), DECODE_TOKENS)]  # mixed


def _save(path: Path, state: dict[str, object]) -> None:
    """Atomically (several instances of one model may start at once)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(state))
        temporary.replace(path)
    except OSError as e:  # a read-only cache: the next start profiles again
        logger.warning("could not save the step time model to %s: %s", path, e)

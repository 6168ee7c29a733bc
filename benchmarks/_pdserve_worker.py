"""vs_vllm.py's pdserve side: an `LLMEngine` behind the JSON-lines loop of _peer_worker.py.

    .venv/bin/python benchmarks/_pdserve_worker.py SPEC_JSON

SPEC: ``model`` (directory), ``threads``, ``max_model_len``, ``max_num_seqs``,
``max_num_batched_tokens``, ``kv_cache_bytes``, ``block_size`` (None: the engine's default, 16).
The engine runs float32 with prefix caching; `offline` is `LLMEngine.generate`, `stream`
iterates `LLMEngine.stream` (each output it yields is one step's token, detokenized as the
engine always does); `reference` runs `transformers`' greedy `generate` on a few prompts of the
same directory (after the measurements: it loads a second copy of the weights).
"""

import dataclasses
import time
from typing import Any

import torch
from _peer_worker import Handler, serve, stream_reply

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import SamplingParams


def load(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Handler]]:
    torch.set_num_threads(int(spec["threads"]))
    block_size = {} if spec["block_size"] is None else {"block_size": int(spec["block_size"])}
    config = EngineConfig(
        **block_size,
        model=spec["model"],
        dtype="float32",
        max_model_len=int(spec["max_model_len"]),
        max_num_seqs=int(spec["max_num_seqs"]),
        max_num_batched_tokens=int(spec["max_num_batched_tokens"]),
        kv_cache_bytes=int(spec["kv_cache_bytes"]),
        enable_prefix_caching=True,
        torch_threads=int(spec["threads"]),
    )
    engine = LLMEngine.from_config(config)

    def offline(command: dict[str, Any]) -> dict[str, Any]:
        params = SamplingParams(max_tokens=int(command["max_tokens"]), ignore_eos=True)
        start = time.perf_counter()
        done = engine.generate(command["prompts"], params)
        seconds = time.perf_counter() - start
        return {
            "seconds": seconds,
            "token_ids": [list(c.token_ids) for c in done],
            "cached_tokens": [c.num_cached_tokens for c in done],
        }

    def stream(command: dict[str, Any]) -> dict[str, Any]:
        params = SamplingParams(max_tokens=int(command["max_tokens"]), ignore_eos=True)
        times: list[float] = []
        tokens: list[int] = []
        start = time.perf_counter()
        for out in engine.stream(command["prompt"], params):
            now = time.perf_counter()
            tokens.extend(out.new_token_ids)
            times.extend(now for _ in out.new_token_ids)
        return stream_reply(start, times, tokens)

    def reference(command: dict[str, Any]) -> dict[str, Any]:
        return {"token_ids": transformers_greedy(spec["model"], command)}

    return describe(engine, config), {"offline": offline, "stream": stream, "reference": reference}


def describe(engine: LLMEngine, config: EngineConfig) -> dict[str, Any]:
    """The settings the engine runs with."""
    return {
        "engine": "pdserve",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "block_size": engine.kv_cache.block_size,
        "num_kv_blocks": engine.kv_cache.num_blocks,
        "max_model_len": engine.max_model_len,
        "config": dataclasses.asdict(config),
    }


def transformers_greedy(model_dir: str, command: dict[str, Any]) -> list[list[int]]:
    """`generate(do_sample=False)` of `transformers` on each prompt alone, EOS not stopping it
    (nor masked), for a check of both engines' greedy tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in command["prompts"]:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=int(command["max_tokens"]),
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


if __name__ == "__main__":
    serve(load)
